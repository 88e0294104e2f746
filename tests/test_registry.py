"""``Registry``: built-ins imported on first use, names registered in the process, and entry points of
installed distributions (a real ``*.dist-info`` on the path, as pip leaves it)."""

from __future__ import annotations

import sys

import pytest

from specdec.registry import Registry, UnknownNameError

GROUP = "specdec.test_plugins"


def _install(site, dist: str, module: str, entries: dict[str, str], code: str) -> None:
    (site / f"{module}.py").write_text(code)
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}\n")


def test_builtins_load_lazily_and_registration_wins():
    reg = Registry("thing", GROUP, {"json": "json:dumps", "nested": "os.path:join"})
    assert reg.names() == ["json", "nested"] and "json" in reg and "yaml" not in reg
    import json
    import os

    assert reg.get("json") is json.dumps and reg.get("nested") is os.path.join
    reg.register("json", len)
    assert reg.get("json") is len
    reg.register("late", "math:sqrt")
    assert reg.get("late")(9.0) == 3.0
    with pytest.raises(UnknownNameError, match="unknown thing 'yaml'; choose one of: json, late, nested"):
        reg.get("yaml")
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("", len)


def test_entry_points_of_installed_distributions(tmp_path, monkeypatch):
    _install(tmp_path, "plugin_dist", "plugin_mod", {"ext": "plugin_mod:VALUE", "json": "plugin_mod:VALUE"},
             "VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("thing", GROUP, {"json": "json:dumps"}, missing="no {kind} {name} (have {choices})")
    with pytest.warns(UserWarning, match="'json' from the installed entry point 'plugin_mod:VALUE' is ignored"):
        assert reg.names() == ["ext", "json"]
    assert reg.get("ext") == 42 and "plugin_mod" in sys.modules
    import json

    assert reg.get("json") is json.dumps  # an entry point never shadows a built-in
    with pytest.raises(UnknownNameError, match=r"no thing 'nope' \(have ext, json\)"):
        reg.get("nope")
    monkeypatch.undo()
    reg.refresh()
    assert reg.names() == ["json"]


def test_backends_and_architectures_plug_in_through_the_same_registry(tiny_checkpoint):
    from specdec import LLM, SamplingParams
    from specdec.backends import available_backends, register_backend
    from specdec.backends.torch_ref import TorchBackend
    from specdec.models.registry import model_class, register_architecture, supported_model_types

    class Counting(TorchBackend):
        calls = 0

        def attention(self, *args, **kwargs):
            Counting.calls += 1
            return super().attention(*args, **kwargs)

    register_backend("counting-test", Counting)
    assert "counting-test" in available_backends()
    folder = str(tiny_checkpoint("llama"))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    plain = LLM(folder, dtype="float64", kv_cache_memory=1 << 20).generate([[1, 2, 3]], params, use_tqdm=False)
    counted = LLM(folder, dtype="float64", kv_cache_memory=1 << 20, attention_backend="counting-test")
    assert counted.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids == plain[0].token_ids
    assert Counting.calls > 0
    register_architecture("llama-test-alias", "specdec.models.llama:LlamaForCausalLM")
    assert "llama-test-alias" in supported_model_types()

    class Config:
        model_type = "llama-test-alias"

    assert model_class(Config).__name__ == "LlamaForCausalLM"
    Config.model_type = "gpt2"
    with pytest.raises(UnknownNameError, match="unsupported model_type 'gpt2'; supported: .*llama-test-alias"):
        model_class(Config)
