import pytest
import torch

import robust_attn
from robust_attn.models.registry import MODELS, register_model

# Every architecture the zoo promises.
EXPECTED = """resnet26 resnet38 resnet50 san10_pairwise san15_pairwise san19_pairwise san10_patchwise
san15_patchwise san19_patchwise sasa_resnet26 sasa_resnet38 sasa_resnet50 gsa_resnet26 gsa_resnet38
gsa_resnet50 gsa_resnet101 aa_resnet26 aa_resnet34 aa_resnet38 aa_resnet50 aa_resnet101 aa_wrn28_10
ea_resnet26 ea_resnet38 ea_resnet50""".split()


def test_every_promised_architecture_is_registered():
    assert set(EXPECTED) <= set(robust_attn.list_models())


def test_list_models_filters_with_wildcards():
    assert robust_attn.list_models("resnet*") == ["resnet26", "resnet38", "resnet50"]
    assert robust_attn.list_models("nothing*") == []
    assert robust_attn.list_models(family="resnet") == ["resnet26", "resnet38", "resnet50"]


def test_create_model_records_how_to_rebuild_it():
    model = robust_attn.create_model("resnet26", num_classes=7, resolution="cifar", width=0.25)
    assert model.arch_args == {"name": "resnet26", "num_classes": 7, "resolution": "cifar",
                               "overrides": {"width": 0.25}}
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 7)


def test_unknown_model_suggests_close_names():
    with pytest.raises(KeyError, match="resnet26"):
        robust_attn.create_model("resnet62")


def test_bad_resolution_override_and_classes_are_clear_errors():
    with pytest.raises(ValueError, match="unknown resolution"):
        robust_attn.create_model("resnet26", resolution="mnist")
    with pytest.raises(ValueError, match="does not take override"):
        robust_attn.create_model("resnet26", depth=3)
    with pytest.raises(ValueError, match="num_classes"):
        robust_attn.create_model("resnet26", num_classes=0)
    with pytest.raises(ValueError, match="stem_downsample"):
        robust_attn.create_model("resnet26", stem_downsample=3)


def test_register_model_rejects_duplicates_and_registers_by_function_name():
    @register_model(family="test", paper="a test")
    def _tiny_test_model(num_classes=1000, resolution="imagenet"):
        return torch.nn.Linear(3, num_classes)

    try:
        assert robust_attn.model_info("_tiny_test_model").family == "test"
        with pytest.raises(ValueError, match="twice"):
            register_model(_tiny_test_model)
    finally:
        MODELS.remove("_tiny_test_model")
