"""Inductor's settings in the key: its whole portable config minus a deny-list (issue 33).

Real torch, no compiles: a tiny ``symbolic_trace`` graph keyed by ``backend_key`` under
``torch._inductor.config.patch(...)``, and the factors computed again in fresh processes.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import torch
from torch._inductor import config

from aotc._torch.inductor_facts import CONFIG_DENY, _config_patch, config_values
from aotc.backend.config import DEFAULT_INDUCTOR, BackendConfig
from aotc.backend.serve import backend_key
from aotc.records.key import canonical_json
from tests.conftest import PYTHON, python_env


class _Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.relu(x) * 2.0,)


@pytest.fixture(scope="module")
def graph() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    return torch.fx.symbolic_trace(_Tiny()), [torch.randn(4, 8)]


# No backend patches: the graph compiles with this process's Inductor config as it stands.
_PLAIN = BackendConfig.make(inductor={})


def _key(graph: tuple[Any, list[torch.Tensor]], cfg: BackendConfig = _PLAIN) -> str:
    return backend_key(graph[0], graph[1], cfg)[0]


@pytest.mark.parametrize("name", ["cpp.dynamic_threads", "shape_padding", "comprehensive_padding"])
def test_an_in_process_change_of_a_code_changing_setting_changes_the_key(graph, name: str) -> None:
    before = _key(graph)
    with config.patch({name: not _get(name)}):
        changed = _key(graph)
    assert changed != before
    assert _key(graph) == before  # the patch is gone, the key is back


def test_a_backend_patch_wins_over_the_process_setting(graph) -> None:
    """A backend made with ``cpp.dynamic_threads=True`` compiles with it whatever the process
    has: the process's value cannot change the kernels, so it does not change the key."""
    dynamic = BackendConfig.make(inductor={"cpp.dynamic_threads": True})
    before = _key(graph, dynamic)
    with config.patch({"cpp.dynamic_threads": False}):
        assert _key(graph, dynamic) == before


def test_the_thread_count_kernels_are_written_for_is_keyed(graph) -> None:
    """The default backend compiles as Inductor does (no patch: kernels for the process's thread
    count), so another thread count is another key, as in Inductor's FX graph cache; kernels
    that read the count at run time (``cpp.dynamic_threads``) or a fixed ``cpp.threads`` are
    keyed the same under any count."""
    assert BackendConfig().inductor == DEFAULT_INDUCTOR
    dynamic = BackendConfig.make(inductor={"cpp.dynamic_threads": True})
    fixed = BackendConfig.make(inductor={"cpp.threads": 4})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (_key(graph), _key(graph, dynamic), _key(graph, fixed))
        torch.set_num_threads(2)
        two = (_key(graph), _key(graph, dynamic), _key(graph, fixed))
    finally:
        torch.set_num_threads(threads)
    assert one[0] != two[0]
    assert one[1:] == two[1:]


@pytest.mark.parametrize("patch", [{"compile_threads": 1}, {"global_cache_dir": "/tmp/elsewhere"},
                                   {"worker_start_method": "fork"},
                                   {"trace.debug_dir": "/tmp/debug"}, {"trace.enabled": True}])
def test_a_denied_setting_keeps_the_key(graph, patch: dict[str, Any]) -> None:
    before = _key(graph)
    with config.patch(patch):
        assert _key(graph) == before


def test_aotc_patching_config_around_a_compile_keeps_the_key(graph) -> None:
    """Keyed before, during (aotc's fixed config + the backend's patches) and after a compile."""
    cfg = BackendConfig.make(inductor={"shape_padding": not config.shape_padding})
    before = _key(graph, cfg)
    with _config_patch(dict(cfg.inductor)):
        assert _key(graph, cfg) == before
    assert _key(graph, cfg) == before


def test_aotcs_fixed_config_is_in_the_values() -> None:
    values = config_values()
    assert values["cpp_cache_precompile_headers"] is True and values["cpp.vec_isa_ok"] is True
    assert "torch.ops.higher_order.cond" in values["unsafe_marked_cacheable_functions"]
    with config.patch({"cpp.vec_isa_ok": False}):  # aotc compiles with it on regardless
        assert config_values() == values


def test_the_values_are_the_whole_portable_config_minus_the_deny_list() -> None:
    values = config_values()
    assert len(values) > 400 and not any(k.startswith(tuple(CONFIG_DENY)) for k in values)
    for name in ("compile_threads", "worker_start_method", "trace.debug_dir", "global_cache_dir"):
        assert name not in values
    for name in ("cpp.dynamic_threads", "shape_padding", "comprehensive_padding", "cpp.threads",
                 "trace.provenance_tracking_level", "post_grad_custom_post_pass"):
        assert name in values
    canonical_json({"values": values})  # JSON-able: raises on anything that is not
    assert values == json.loads(json.dumps(values))  # a memo round trip keeps every value


def test_a_compiler_path_is_keyed_by_its_name() -> None:
    with config.patch({"cpp.cxx": (None, "/opt/gcc/bin/g++-13")}):
        assert config_values()["cpp.cxx"] == [None, "g++-13"]


def test_a_value_with_no_stable_spelling_raises() -> None:
    with config.patch({"post_grad_custom_post_pass": lambda g: None}), \
            pytest.raises(TypeError, match="post_grad_custom_post_pass"):
        config_values()
    with config.patch({"aot_inductor.aoti_shim_library_path": "/opt/lib/shim.so"}), \
            pytest.raises(TypeError, match="absolute path"):
        config_values()


def test_a_denied_setting_may_hold_anything() -> None:
    with config.patch({"trace.upload_tar": lambda path: None}):
        config_values()


def test_a_custom_pass_is_keyed_by_its_uuid(graph) -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Pass(CustomGraphPass):
        def __init__(self, uid: str) -> None:
            self.uid = uid

        def __call__(self, g: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return self.uid

    before = _key(graph)
    with config.patch({"post_grad_custom_post_pass": Pass("a")}):
        assert config_values()["post_grad_custom_post_pass"] == {"uuid": "a"}
        a = _key(graph)
    with config.patch({"post_grad_custom_post_pass": Pass("b")}):
        b = _key(graph)
    assert len({before, a, b}) == 3


_FACTORS = """
import json, sys
{imports}
from aotc._torch.inductor_facts import config_values
from aotc.lookup.resolve import inductor_factors
from aotc.records.key import compute_key
f = inductor_factors({{}}, config_values(), "cpu")
print(json.dumps({{"key": compute_key(f), "factors": f}}, sort_keys=True))
"""


def _fresh(imports: str, seed: str) -> dict[str, Any]:
    env = {**python_env(), "PYTHONHASHSEED": seed}
    res = subprocess.run([PYTHON, "-c", _FACTORS.format(imports=imports)], capture_output=True,
                         text=True, env=env, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_factors_are_equal_in_fresh_processes_whatever_was_imported_first() -> None:
    plain = _fresh("", "1")
    primed = _fresh("import torch._inductor.codecache, torch._inductor.compile_fx, torch._dynamo", "2")
    assert plain == primed


def _get(name: str) -> Any:
    obj: Any = config
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj
