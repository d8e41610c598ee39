"""Training: recipes (:mod:`.recipe`), SGD and schedules (:mod:`.optim`), the loop (:mod:`.trainer`), its
checkpoints and resume (:mod:`.checkpoints`), precision (:mod:`.precision`), what a checkpoint records of
its making (:mod:`.provenance`), adversarial training (:mod:`.adversarial`) and weight averaging (:mod:`.ema`)."""
from robust_attn.train.recipe import Recipe, RecipeError, load_recipe, parse_overrides, recipe_from_dict
from robust_attn.train.trainer import build_model, evaluate, train

__all__ = ["Recipe", "RecipeError", "load_recipe", "parse_overrides", "recipe_from_dict", "train", "evaluate",
           "build_model"]
