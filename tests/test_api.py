"""The top-level API: ``import ndplan`` gives the entry points, loaded on first use."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import ndplan


def test_every_export_is_the_object_its_module_defines():
    from importlib import import_module

    for name, module in ndplan._EXPORTS.items():
        assert getattr(ndplan, name) is getattr(import_module(module), name), name
    assert set(ndplan.__all__) == {"__version__", *ndplan._EXPORTS} and dir(ndplan) == sorted(ndplan.__all__)
    with pytest.raises(AttributeError, match="no attribute 'estimte'"):
        ndplan.estimte  # noqa: B018


def test_import_is_lazy():
    """``import ndplan`` loads neither numpy nor pydantic until an entry point is used."""
    code = "import sys, ndplan; print('numpy' in sys.modules, 'pydantic' in sys.modules); ndplan.Strategy; " \
           "print('pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True"]


def test_the_docstring_walkthrough_runs_and_agrees_with_the_modules():
    model = ndplan.get_preset("llama-3.1-8b")
    device = ndplan.get_device("h100-sxm")
    strategy = ndplan.Strategy(dp=4, tp=2, sequence_parallel=True, zero=1, num_micro_batches=4, recompute="full",
                               seq_length=4096)
    memory = ndplan.estimate(model, strategy, device, num_devices=8)
    cluster = ndplan.Cluster(device=device, num_devices=8)
    time = ndplan.estimate_time(model, strategy, cluster)
    assert memory.fits and 0 < time.step_s < 10
    space = ndplan.default_space(model, device, 8, 16, 4096, dims=("tp", "zero", "recompute"))
    from ndplan.search import runtime_step_time

    result = ndplan.run_search(model, device, space)  # the step-time model of the default runtime
    explicit = ndplan.run_search(model, device, space, runtime_step_time(ndplan.MemoryOptions()))
    assert result.best is not None and result.best["candidate"] == explicit.best["candidate"]
    assert result.best["step_s"] == explicit.best["step_s"]
    # The device's own figures are fused kernels: faster than the pytorch runtime's eager ones.
    assert ndplan.run_search(model, device, space, ndplan.step_time_batch).best["step_s"] < result.best["step_s"]


def test_readme_python_example_runs():
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start = readme.index("```python\nimport ndplan\n") + len("```python\n")
    code = readme[start:readme.index("```", start)]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
    assert scope["memory"].fits and scope["result"].best is not None
    assert scope["result"].best["peak_bytes"] <= scope["device"].memory_bytes


def test_api_input_errors_name_what_is_wrong():
    """The API refuses bad input as the CLI does, with an NdplanError naming the value."""
    from ndplan.errors import NdplanError

    model, device = ndplan.get_preset("llama-3.1-8b"), ndplan.get_device("h100-sxm")
    with pytest.raises(NdplanError, match="attention must be one of flash, sdpa, eager, flex, got 'xx'"):
        ndplan.MemoryOptions(attention="xx")
    with pytest.raises(NdplanError, match="unknown runtime 'tpu'"):
        ndplan.MemoryOptions(runtime="tpu")
    with pytest.raises(NdplanError, match="global_batch_size must be a whole number >= 1, got 0"):
        ndplan.default_space(model, device, 8, 0, 4096)
    space = ndplan.default_space(model, device, 8, 32, 4096, dims=("tp", "zero"))
    with pytest.raises(NdplanError, match="memory_limit_bytes must be > 0"):
        ndplan.run_search(model, device, space, memory_limit_bytes=0)
    with pytest.raises(NdplanError, match="top must be a whole number >= 1, got -1"):
        ndplan.run_search(model, device, space, top=-1)
    # a size as the CLI writes it, and a model and device by name
    assert ndplan.run_search(model, device, space, memory_limit_bytes="70GiB").memory_limit_bytes == 70 * 2**30
    by_name = ndplan.estimate("llama-3.1-8b", ndplan.Strategy(dp=8), "h100-sxm", num_devices=8)
    assert by_name.peak_bytes == ndplan.estimate(model, ndplan.Strategy(dp=8), device, num_devices=8).peak_bytes


def test_entry_points_take_names_and_estimate_time_takes_the_runtime_options():
    """A model and device by name reach every entry point; ``estimate_time(options=...)``
    prices what ``estimate`` and the CLI price for that runtime (without it: the device
    profile's figures), and arguments in the wrong place are named, not an AttributeError."""
    from ndplan.errors import NdplanError

    model, device = ndplan.get_preset("llama-3.1-8b"), ndplan.get_device("h100-sxm")
    strategy = ndplan.Strategy(dp=2, pp=4, vpp=2, schedule="zbv", zero=1, recompute="full", num_micro_batches=8,
                               global_batch_size=16)
    cluster = ndplan.Cluster(device=device, num_devices=8)
    options = ndplan.MemoryOptions()  # pytorch: a split backward rebuilds per parameter group
    by_keywords = ndplan.estimate_time(model, strategy, cluster, **options.time_keywords())
    by_options = ndplan.estimate_time("llama-3.1-8b", strategy, "h100-sxm", options=options)
    assert by_options.step_s == by_keywords.step_s
    assert ndplan.estimate_time(model, strategy, device).step_s != by_options.step_s  # the device profile's
    space = ndplan.default_space("llama-3.1-8b", "h100-sxm", 8, 16, 4096, dims=("tp", "zero"))
    assert ndplan.run_search("llama-3.1-8b", "h100-sxm", space).best is not None
    with pytest.raises(NdplanError, match=r"check_strategy\(strategy, model, num_devices\) takes a Strategy"):
        ndplan.check_strategy(model, strategy, 8)
    with pytest.raises(NdplanError, match="cluster must be a Device or a device name, got int"):
        ndplan.estimate_time(model, strategy, 8)
    with pytest.raises(NdplanError, match="device must be a Device or a device name, got int"):
        ndplan.default_space(model, 8, 8, 16, 4096)


def test_every_public_name_says_what_it_does():
    """A review found get_preset, get_precision, preset_names and seven methods without a docstring."""
    import inspect

    import ndplan

    missing = [name for name in ndplan.__all__ if callable(getattr(ndplan, name))
               and not (getattr(ndplan, name).__doc__ or "").strip()]
    for name in ndplan.__all__:
        obj = getattr(ndplan, name)
        if inspect.isclass(obj):
            missing += [f"{name}.{k}" for k, v in vars(obj).items()
                        if not k.startswith("_") and inspect.isfunction(v) and not (v.__doc__ or "").strip()]
    assert missing == []


def test_wrong_argument_types_are_ndplan_errors():
    """They raised AttributeError ('NoneType' object has no attribute 'lower') or TypeError."""
    import pytest

    import ndplan

    calls = {
        "preset name must be a name": lambda: ndplan.get_preset(None),
        "device name must be a name": lambda: ndplan.get_device(None),
        "precision name must be a name": lambda: ndplan.get_precision(None),
        "model must be a ModelSpec or a model name": lambda: ndplan.count_parameters(None),
        "space must be a SearchSpace": lambda: ndplan.run_search("llama-3.1-8b", "h100-sxm", None),
        "options must be a MemoryOptions": lambda: ndplan.estimate("llama-3.1-8b", ndplan.Strategy(), "h100-sxm",
                                                                   "megatron"),
    }
    for message, call in calls.items():
        with pytest.raises(ndplan.NdplanError, match=message):
            call()
    assert ndplan.count_parameters("llama-3.1-8b").total == 8_030_261_248


def test_estimate_time_names_a_bad_efficiency_overlap_or_software():
    """A fuzzing review: efficiency="x" and overlap="x" raised AttributeError deep in the time
    model, software=5 a TypeError. An overlap written as the CLI writes it is read."""
    strategy = ndplan.Strategy(dp=8, num_micro_batches=4)
    calls = {
        r"efficiency must be an EfficiencyProfile .* got str": dict(efficiency="x"),
        r"unknown overlap preset 'x'.*known: megatron": dict(overlap="x"),
        r"overlap: expected a preset name, key=value pairs or a mapping, got int": dict(overlap=5),
        r"software must be a mapping of selective_recompute, .* got int": dict(software=5),
    }
    for message, keywords in calls.items():
        with pytest.raises(ndplan.NdplanError, match=message):
            ndplan.estimate_time("llama-3.1-8b", strategy, "h100-sxm", **keywords)
    plain = ndplan.estimate_time("llama-3.1-8b", strategy, "h100-sxm", overlap="plain")
    assert plain.overlap == ndplan.perf.get_overlap("plain")


def test_run_search_names_a_bad_limit_block_size_options_or_time_function():
    """A fuzzing review: an infinite limit raised OverflowError, a list TypeError, block_size 0
    "generator raised StopIteration", options='megatron' AttributeError and a time function
    returning {} KeyError 'step_s'."""
    model, device = ndplan.get_preset("llama-3.1-8b"), ndplan.get_device("h100-sxm")
    space = ndplan.default_space(model, device, 8, 32, 4096, dims=("tp",))
    calls = {
        r"memory_limit_bytes must be > 0 and below 8 EiB: a number of bytes or a size such as '70GiB', or None "
        r"for the device's memory; got inf": dict(memory_limit_bytes=float("inf")),
        r"memory_limit_bytes must be > 0 .* got nan": dict(memory_limit_bytes=float("nan")),
        r"memory_limit_bytes must be > 0 .* got \[1\]": dict(memory_limit_bytes=[1]),
        r"memory_limit_bytes: cannot read 'lots' as a size": dict(memory_limit_bytes="lots"),
        r"block_size must be a whole number >= 1, got 0": dict(block_size=0),
        r"block_size must be a whole number >= 1, got -1": dict(block_size=-1),
        r"block_size must be a whole number >= 1, got 1.5": dict(block_size=1.5),
        r"options must be a MemoryOptions \(e.g. MemoryOptions\(runtime='megatron'\)\), got str": dict(options="megatron"),
        r"time_function must return a dict of arrays with 'step_s' \(seconds per strategy of the batch, \d+ here\), "
        r"got keys \[\]": dict(time_function=lambda *_: {}),
        r"time_function must return .* got NoneType": dict(time_function=lambda *_: None),
    }
    for message, keywords in calls.items():
        with pytest.raises(ndplan.NdplanError, match=message):
            ndplan.run_search(model, device, space, **keywords)
    # numpy's integers are whole numbers too
    assert ndplan.run_search(model, device, space, top=np.int64(2), block_size=np.int64(64)).best is not None


def test_default_space_bounds_its_sizes_and_takes_numpy_integers():
    """A fuzzing review: seq_length 2^62 hung listing the context-parallel degrees (a scan up to
    seq/8192), devices or a fixed degree of 2^70 were accepted and overflowed int64 in the search,
    and np.int64(8) devices were refused where ``estimate`` takes them."""
    from ndplan.search.space import _divisors

    model, device = ndplan.get_preset("llama-3.1-8b"), ndplan.get_device("h100-sxm")
    calls = {
        "seq_length must be at most 16,777,216, got 4611686018427387904": (8, 32, 2**62, {}),
        "num_devices must be at most 1,048,576, got 1180591620717411303424": (2**70, 32, 4096, {}),
        "global_batch_size must be at most 1,073,741,824": (8, 2**40, 4096, {}),
        "num_devices must be a whole number >= 1, got 8.0": (8.0, 32, 4096, {}),
        "tp must be at least 1 and at most 1,048,576": (8, 32, 4096, {"fixed": {"tp": 2**70}}),
        "etp must be at least 0 and at most 1,048,576": (8, 32, 4096, {"fixed": {"etp": 2**21}}),
        r"fixed must be a mapping of dimension names to values \(e.g. \{'tp': 8\}\), got list": (8, 32, 4096,
                                                                                                {"fixed": [1]}),
        "unknown precision policy 'bogus'; known: megatron-bf16": (8, 32, 4096, {"precision": "bogus"}),
        "precision must be a precision policy or its name, got 3": (8, 32, 4096, {"precision": 3}),
    }
    for message, (devices, gbs, seq, keywords) in calls.items():
        with pytest.raises(ndplan.NdplanError, match=message):
            ndplan.default_space(model, device, devices, gbs, seq, **keywords)
    # a precision's name, as Strategy and the CLI take it
    assert ndplan.default_space(model, device, 8, 32, 4096, precision="fp32").precision == ndplan.get_precision("fp32")
    numpy_sized = ndplan.default_space(model, device, np.int64(8), np.int64(32), np.int64(4096))
    assert numpy_sized == ndplan.default_space(model, device, 8, 32, 4096)
    # the largest sizes make a space the search runs without overflow
    largest = ndplan.default_space(model, device, 2**20, 2**30, 2**24, dims=("tp", "pp"), fixed={"cp": 2**20})
    assert ndplan.run_search(model, device, largest).rejected["world_size"] > 0
    assert _divisors(2**20, 2**11) == [2**k for k in range(12)] and _divisors(720, 16) == [1, 2, 3, 4, 5, 6, 8, 9,
                                                                                           10, 12, 15, 16]


def test_a_str_where_a_list_is_expected_is_one_item_not_its_characters():
    """A fuzzing review: dims="tp" said "unknown search dimension 'p'", recompute_modules=
    "core_attn" "unknown recompute module 'c'", offload_modules="attn_norm" "unknown offload
    module '_'"."""
    model, device = ndplan.get_preset("qwen3-30b-a3b"), ndplan.get_device("h100-sxm")
    assert ndplan.Strategy(recompute="selective", recompute_modules="layernorm").recompute_modules == ("layernorm",)
    assert ndplan.Strategy(offload_modules="attn_norm").offload_modules == ("attn_norm",)
    space = ndplan.default_space(model, device, 8, 32, 4096, dims="tp", recompute_modules="layernorm+moe_act",
                                 offload_modules="expert_fc1")
    assert space == ndplan.default_space(model, device, 8, 32, 4096, dims=("tp",),
                                         recompute_modules=("layernorm", "moe_act"), offload_modules=("expert_fc1",))
    assert len(space.tp) > 1 and space.zero == (1,)
    with pytest.raises(ndplan.NdplanError, match="recompute module set 'core_attn\\+bogus': unknown module 'bogus'"):
        ndplan.default_space(model, device, 8, 32, 4096, recompute_modules="core_attn+bogus")
    with pytest.raises(ValueError, match="recompute_modules.0\n.*Input should be 'core_attn'"):
        ndplan.Strategy(recompute="selective", recompute_modules="bogus")
