"""The one registry every plug-in point uses (robust_attn.utils.plugins)."""
import sys

import pytest

from robust_attn.utils.plugins import Registry


def test_register_get_names_and_the_duplicate_check():
    reg = Registry("widget", error=ValueError)

    @reg.add()
    def round_widget():
        return "round"

    reg.register("square", "a square")
    assert reg.get("round_widget") is round_widget
    assert reg.names() == ["round_widget", "square"]
    assert "square" in reg and "triangle" not in reg and len(reg) == 2
    assert list(reg.items()) == [("round_widget", round_widget), ("square", "a square")]
    with pytest.raises(ValueError, match="widget 'square' is registered twice"):
        reg.register("square", "another")
    assert reg.remove("square") == "a square" and reg.names() == ["round_widget"]


def test_an_unknown_name_names_the_closest_and_all():
    reg = Registry("widget", error=LookupError, hint="`widgets list` shows them.")
    for name in ("gaussian", "shot", "impulse"):
        reg.register(name, name)
    with pytest.raises(LookupError) as err:
        reg.get("gausian")
    assert str(err.value) == ("unknown widget 'gausian'. Did you mean 'gaussian'? Choose one of gaussian, impulse, "
                              "shot. `widgets list` shows them.")
    with pytest.raises(LookupError, match=r"^unknown widget 'zzz'\. Choose one of"):
        reg.get("zzz")


def test_a_package_registry_imports_every_module_once_on_first_use(tmp_path, monkeypatch):
    package = tmp_path / "plugpkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from robust_attn.utils.plugins import Registry\nPLUGS = Registry('plug', package='plugpkg')\n")
    for name in ("alpha", "beta"):
        (package / f"{name}.py").write_text(f"from plugpkg import PLUGS\nPLUGS.register('{name}', '{name}!')\n")
    (package / "_private.py").write_text("raise RuntimeError('a private module is not a plug-in')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import plugpkg

        assert "plugpkg.alpha" not in sys.modules          # nothing imported before it is asked
        assert plugpkg.PLUGS.names() == ["alpha", "beta"]
        assert plugpkg.PLUGS.get("beta") == "beta!"
        assert plugpkg.PLUGS.names() == ["alpha", "beta"]   # imported once: no "registered twice"
    finally:
        for name in [n for n in sys.modules if n == "plugpkg" or n.startswith("plugpkg.")]:
            del sys.modules[name]


@pytest.mark.parametrize("names, expected", [
    (lambda: __import__("robust_attn.data", fromlist=["list_datasets"]).list_datasets(),
     {"cifar10", "cifar100", "fashion_mnist", "imagefolder", "imagenet", "synthetic"}),
    (lambda: __import__("robust_attn.importers", fromlist=["IMPORTERS"]).IMPORTERS.names(),
     {"san-official", "torchvision-resnet"}),
    (lambda: __import__("robust_attn.sources", fromlist=["list_sources"]).list_sources(),
     {"callable", "registry", "san-official", "timm", "torchvision", "zoo"}),
])
def test_plug_in_points_find_their_modules_without_a_list(names, expected):
    assert expected <= set(names())


def test_a_corruption_registered_besides_the_papers_19_is_a_corruption():
    import numpy as np

    from robust_attn.shifts.corruptions import CORRUPTIONS, check_corruption, corrupt_batch, register

    register("white_test")(lambda x, severity, rngs: x * 0 + 1)
    try:
        assert check_corruption("white_test") == "white_test"
        assert (corrupt_batch(np.full((2, 4, 4, 3), 10, np.uint8), "white_test", 3) == 255).all()
    finally:
        CORRUPTIONS.remove("white_test")
    with pytest.raises(ValueError, match="unknown corruption 'white_test'"):
        check_corruption("white_test")
