"""ImageNet-A (Hendrycks et al., "Natural Adversarial Examples", CVPR 2021): 7,500 real photos
of 200 ImageNet classes that ResNet-50s misclassify.

Published layout: ``imagenet-a/<wnid>/*.jpg`` (the ``imagenet-a.tar`` of
github.com/hendrycks/natural-adv-examples), read from ``ROOT/imagenet-a``. Labels index
:data:`WNIDS`, the 200 classes sorted; an ImageNet model's logits are restricted to these 200 of
its 1,000 (``INFO.logit_subset``), as the authors' ``eval.py`` does.
"""
from __future__ import annotations

from robust_attn.data.base import register_dataset
from robust_attn.data.class_folders import folder_test_set
from robust_attn.data.imagenet import wnid_index

__all__ = ["INFO", "WNIDS", "locate", "build", "TAKES_TRANSFORM"]

#: the 200 ImageNet-1k wnids of ImageNet-A, sorted (the authors' ``imagenet_a_wnids``)
WNIDS = (
    "n01498041", "n01531178", "n01534433", "n01558993", "n01580077", "n01614925", "n01616318", "n01631663",
    "n01641577", "n01669191", "n01677366", "n01687978", "n01694178", "n01698640", "n01735189", "n01770081",
    "n01770393", "n01774750", "n01784675", "n01819313", "n01820546", "n01833805", "n01843383", "n01847000",
    "n01855672", "n01882714", "n01910747", "n01914609", "n01924916", "n01944390", "n01985128", "n01986214",
    "n02007558", "n02009912", "n02037110", "n02051845", "n02077923", "n02085620", "n02099601", "n02106550",
    "n02106662", "n02110958", "n02119022", "n02123394", "n02127052", "n02129165", "n02133161", "n02137549",
    "n02165456", "n02174001", "n02177972", "n02190166", "n02206856", "n02219486", "n02226429", "n02231487",
    "n02233338", "n02236044", "n02259212", "n02268443", "n02279972", "n02280649", "n02281787", "n02317335",
    "n02325366", "n02346627", "n02356798", "n02361337", "n02410509", "n02445715", "n02454379", "n02486410",
    "n02492035", "n02504458", "n02655020", "n02669723", "n02672831", "n02676566", "n02690373", "n02701002",
    "n02730930", "n02777292", "n02782093", "n02787622", "n02793495", "n02797295", "n02802426", "n02814860",
    "n02815834", "n02837789", "n02879718", "n02883205", "n02895154", "n02906734", "n02948072", "n02951358",
    "n02980441", "n02992211", "n02999410", "n03014705", "n03026506", "n03124043", "n03125729", "n03187595",
    "n03196217", "n03223299", "n03250847", "n03255030", "n03291819", "n03325584", "n03355925", "n03384352",
    "n03388043", "n03417042", "n03443371", "n03444034", "n03445924", "n03452741", "n03483316", "n03584829",
    "n03590841", "n03594945", "n03617480", "n03666591", "n03670208", "n03717622", "n03720891", "n03721384",
    "n03724870", "n03775071", "n03788195", "n03804744", "n03837869", "n03840681", "n03854065", "n03888257",
    "n03891332", "n03935335", "n03982430", "n04019541", "n04033901", "n04039381", "n04067472", "n04086273",
    "n04099969", "n04118538", "n04131690", "n04133789", "n04141076", "n04146614", "n04147183", "n04179913",
    "n04208210", "n04235860", "n04252077", "n04252225", "n04254120", "n04270147", "n04275548", "n04310018",
    "n04317175", "n04344873", "n04347754", "n04355338", "n04366367", "n04376876", "n04389033", "n04399382",
    "n04442312", "n04456115", "n04482393", "n04507155", "n04509417", "n04532670", "n04540053", "n04554684",
    "n04562935", "n04591713", "n04606251", "n07583066", "n07695742", "n07697313", "n07697537", "n07714990",
    "n07718472", "n07720875", "n07734744", "n07749582", "n07753592", "n07760859", "n07768694", "n07831146",
    "n09229709", "n09246464", "n09472597", "n09835506", "n11879895", "n12057211", "n12144580", "n12267677"
)

INFO, locate, build = folder_test_set(
    "imagenet_a", {w: i for i, w in enumerate(WNIDS)}, WNIDS, ("imagenet-a",),
    how_to_get="Download imagenet-a.tar from https://github.com/hendrycks/natural-adv-examples and extract it under ROOT (ROOT/imagenet-a/<wnid>/*.jpg).",
    logit_subset=[wnid_index()[w] for w in WNIDS])
TAKES_TRANSFORM = True

register_dataset(__name__)
