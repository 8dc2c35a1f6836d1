"""Engine-groups config: every option's flags, every validation rule, and exact launch plans."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from server.engines import launch_plan
from server.engines.launch_config import ROUTER_FLAGS, SGLANG_FLAGS, TANDEM_FLAGS
from server.engines.launch_plan import (
    LaunchConfig,
    LaunchConfigError,
    ServerLaunch,
    load_launch_config,
    parse_launch_config,
    serving_urls,
)
from tandem.commands.engines import engines_app
from tandem.settings import Settings

SGLANG_PY = "/opt/sglang/bin/python"
REPO = Path(__file__).resolve().parents[3]
SERVER = [SGLANG_PY, "-m", "sglang.launch_server"]


def plan(config: LaunchConfig, python: str = SGLANG_PY) -> list[ServerLaunch]:
    return launch_plan.plan(config, python=python)


def router_launch(config: LaunchConfig) -> ServerLaunch | None:
    return launch_plan.router_launch(config, python=SGLANG_PY)


def group(name: str = "g", **fields: Any) -> dict[str, Any]:
    return {"name": name, "model_path": "/models/m", **fields}


def pd_groups(**router: Any) -> dict[str, Any]:
    return {
        "gpus": 2,
        "groups": [
            group("p", role="prefill", transfer_backend="mooncake", base_port=30000),
            group("d", role="decode", transfer_backend="mooncake", base_port=31000),
        ],
        "router": {"port": 8100, **router},
    }


def parse(data: dict[str, Any], check_paths: bool = False) -> LaunchConfig:
    return parse_launch_config(data, check_paths=check_paths)


def one(gpus: int | None = 8, **fields: Any) -> LaunchConfig:
    return parse({"gpus": gpus, "groups": [group(**fields)]})


def errors_of(data: dict[str, Any], check_paths: bool = False) -> list[str]:
    with pytest.raises(LaunchConfigError) as info:
        parse(data, check_paths)
    return info.value.errors


def argv(config: LaunchConfig, index: int = 0) -> list[str]:
    return list(plan(config)[index].argv)


GRAMMAR = ["--grammar-backend", "llguidance", "--constrained-json-disable-any-whitespace"]
BASE = [*SERVER, "--model-path", "/models/m", "--host", "127.0.0.1", "--port", "30000", "--tp-size", "1", *GRAMMAR]


# --- exact plans ----------------------------------------------------------------------------------


def test_realistic_gpu_group_argv_and_env() -> None:
    config = one(
        gpus=4,
        replicas=2,
        tp_size=2,
        quantization="fp8",
        kv_cache_dtype="fp8_e4m3",
        mem_fraction_static=0.85,
        context_length=32768,
        served_model_name="llama",
        weight_version="v7",
        speculative={
            "algorithm": "EAGLE",
            "draft_model_path": "/models/eagle",
            "num_steps": 3,
            "eagle_topk": 1,
            "num_draft_tokens": 4,
        },
    )
    launches = plan(config)
    tail = ["--tp-size", "2", *GRAMMAR]
    tail += ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--context-length", "32768"]
    tail += ["--mem-fraction-static", "0.85", "--served-model-name", "llama", "--weight-version", "v7"]
    tail += ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/models/eagle"]
    tail += ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    head = [*SERVER, "--model-path", "/models/m", "--host", "127.0.0.1", "--port"]
    assert launches == [
        ServerLaunch("g", 0, "http://127.0.0.1:30000", (*head, "30000", *tail), {"CUDA_VISIBLE_DEVICES": "0,1"}),
        ServerLaunch("g", 1, "http://127.0.0.1:30001", (*head, "30001", *tail), {"CUDA_VISIBLE_DEVICES": "2,3"}),
    ]
    assert serving_urls(config) == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert router_launch(config) is None


def test_pd_disaggregated_plan_and_router() -> None:
    data = pd_groups(policy="round_robin")
    data["groups"][0] |= {"replicas": 2, "bootstrap_port": 9000, "ib_device": "mlx5_0"}
    config = parse(data | {"gpus": 3})
    launches = plan(config)
    prefill = [*SERVER, "--model-path", "/models/m", "--host", "127.0.0.1", "--port"]
    pd = ["--tp-size", "1", *GRAMMAR]
    pd += ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake"]
    assert [launch.argv for launch in launches] == [
        (*prefill, "30000", *pd, "--disaggregation-bootstrap-port", "9000", "--disaggregation-ib-device", "mlx5_0"),
        (*prefill, "30001", *pd, "--disaggregation-bootstrap-port", "9001", "--disaggregation-ib-device", "mlx5_0"),
        (*prefill, "31000", "--tp-size", "1", *GRAMMAR, "--disaggregation-mode", "decode", *pd[-2:]),
    ]
    assert [launch.role for launch in launches] == ["prefill", "prefill", "decode"]
    assert [launch.env for launch in launches] == [{"CUDA_VISIBLE_DEVICES": str(gpu)} for gpu in range(3)]
    assert router_launch(config) == ServerLaunch(
        group="router",
        index=0,
        url="http://127.0.0.1:8100",
        argv=(
            *(SGLANG_PY, "-m", "sglang_router.launch_router", "--pd-disaggregation"),
            *("--prefill", "http://127.0.0.1:30000", "9000", "--prefill", "http://127.0.0.1:30001", "9001"),
            *("--decode", "http://127.0.0.1:31000", "--host", "127.0.0.1", "--port", "8100"),
            *("--policy", "round_robin", "--prometheus-port", "29000"),
        ),
        env={},
        role="router",
    )
    assert serving_urls(config) == ["http://127.0.0.1:8100"]


def test_cpu_group_argv_and_env() -> None:
    from server.engines.sglang_cpu.environment import CPU_SERVER_ARGS, cpu_environment

    config = one(gpus=None, device="cpu", env={"OMP_NUM_THREADS": "8"})
    launch = plan(config)[0]
    assert launch.argv == (*BASE, *CPU_SERVER_ARGS)
    assert launch.env == {**cpu_environment({}), "OMP_NUM_THREADS": "8"}
    assert "CUDA_VISIBLE_DEVICES" not in launch.env
    assert "--device" in CPU_SERVER_ARGS and "cpu" in CPU_SERVER_ARGS


def test_a_cpu_group_serves_adapters_with_sglangs_torch_backend() -> None:
    from server.engines.sglang_cpu import SHIM_DIR

    launch = plan(one(gpus=None, device="cpu", lora={"max_loras_per_batch": 4}))[0]
    assert launch.argv[-9:] == (
        *("--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"),
        *("--max-loras-per-batch", "4", "--lora-backend", "torch_native"),
    )
    # Its pinned-memory staging runs through the stand-in folder's sitecustomize, on PYTHONPATH.
    assert (SHIM_DIR / "sitecustomize.py").is_file()
    assert launch.env["PYTHONPATH"].split(":")[0] == str(SHIM_DIR)
    assert errors_of({"groups": [group(device="cpu", lora={"backend": "csgmv"})]}) == [
        'group "g": lora.backend: csgmv needs GPUs (device is cpu); torch_native runs on the CPU'
    ]
    assert errors_of({"gpus": 1, "groups": [group(engine="tandem", lora={})]}) == [
        'group "g": lora: SGLang-only option; the tandem engine does not take it'
    ]
    assert errors_of({"gpus": 1, "groups": [group(extra_args=["--enable-lora"])]}) == [
        'group "g": extra_args: --enable-lora is set by tandem from lora; remove it'
    ]


def test_cpu_group_memory_settings_replace_the_cpu_defaults() -> None:
    from server.engines.sglang_cpu.environment import CPU_SERVER_ARGS

    launch = plan(one(gpus=None, device="cpu", max_total_tokens=4096, mem_fraction_static=0.5))[0]
    cpu_rest = [arg for arg in CPU_SERVER_ARGS if arg not in ("--max-total-tokens", "--mem-fraction-static")]
    assert launch.argv[: len(BASE)] == tuple(BASE)
    assert launch.argv[-4:] == ("--max-total-tokens", "4096", "--mem-fraction-static", "0.5")
    assert launch.argv.count("--max-total-tokens") == 1 and launch.argv.count("--mem-fraction-static") == 1
    assert [arg for arg in launch.argv[len(BASE) : -4] if arg.startswith("--")] == [
        arg for arg in cpu_rest if arg.startswith("--")
    ]


def test_tandem_engine_group() -> None:
    config = one(engine="tandem", replicas=2, base_port=40000, weight_version="v3", served_model_name="smol")
    launches = plan(config)
    assert launches[1] == ServerLaunch(
        group="g",
        index=1,
        url="http://127.0.0.1:40001",
        argv=(
            *(sys.executable, "-m", "tandem.cli", "engine", "--model", "/models/m", "--port", "40001"),
            *("--host", "127.0.0.1", "--weight-version", "v3"),
        ),
        env={"TANDEM_DEVICE": "cuda", "TANDEM_SERVED_MODEL_NAME": "smol", "CUDA_VISIBLE_DEVICES": "1"},
    )
    cpu = plan(one(gpus=None, engine="tandem", device="cpu"))[0]
    assert cpu.argv[-4:] == ("--port", "30000", "--host", "127.0.0.1") and cpu.env == {"TANDEM_DEVICE": "cpu"}


# --- one test per option ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "flags"),
    [
        ({"dp_size": 2, "gpus_per_replica": 2}, ["--dp-size", "2"]),
        ({"quantization": "w8a8_int8"}, ["--quantization", "w8a8_int8"]),
        ({"kv_cache_dtype": "fp8_e5m2"}, ["--kv-cache-dtype", "fp8_e5m2"]),
        ({"context_length": 4096}, ["--context-length", "4096"]),
        ({"max_total_tokens": 65536}, ["--max-total-tokens", "65536"]),
        ({"mem_fraction_static": 0.7}, ["--mem-fraction-static", "0.7"]),
        ({"served_model_name": "chat"}, ["--served-model-name", "chat"]),
        ({"weight_version": "round-12"}, ["--weight-version", "round-12"]),
        (
            {"speculative": {"algorithm": "NGRAM", "num_draft_tokens": 8}},
            ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"],
        ),
        ({"speculative": {"algorithm": "NEXTN"}}, ["--speculative-algorithm", "NEXTN"]),
        (
            {"lora": {}},
            ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all", "--max-loras-per-batch", "8"],
        ),
        (
            {"lora": {"max_rank": 64, "target_modules": ["q_proj", "v_proj"], "backend": "triton"}},
            [
                *("--enable-lora", "--max-lora-rank", "64", "--lora-target-modules", "q_proj", "v_proj"),
                *("--max-loras-per-batch", "8", "--lora-backend", "triton"),
            ],
        ),
        (
            {"extra_args": ["--enable-metrics", "--chunked-prefill-size", "4096"]},
            ["--enable-metrics", "--chunked-prefill-size", "4096"],
        ),
    ],
)
def test_option_adds_its_flags(fields: dict[str, Any], flags: list[str]) -> None:
    built = argv(one(**fields))
    assert built[: len(BASE)] == BASE
    assert built[len(BASE) :] == flags


def test_tp_size_flag_and_default() -> None:
    assert argv(one(tp_size=4))[len(BASE) - 5 : len(BASE) - 3] == ["--tp-size", "4"]
    assert argv(one())[len(BASE) - 5 : len(BASE) - 3] == ["--tp-size", "1"]


@pytest.mark.parametrize(
    ("backend", "flags"),
    [("xgrammar", ["--grammar-backend", "xgrammar", GRAMMAR[-1]]), ("none", ["--grammar-backend", "none"])],
)
def test_grammar_backend(backend: str, flags: list[str]) -> None:
    assert argv(one(grammar_backend=backend))[len(BASE) - 3 :] == flags


def test_model_path_host_and_ports() -> None:
    launches = plan(one(model_path="/srv/qwen", host="10.0.0.5", base_port=20000, port_stride=10, replicas=3))
    assert [launch.url for launch in launches] == [
        "http://10.0.0.5:20000",
        "http://10.0.0.5:20010",
        "http://10.0.0.5:20020",
    ]
    assert launches[2].argv[3:9] == ("--model-path", "/srv/qwen", "--host", "10.0.0.5", "--port", "20020")


@pytest.mark.parametrize(
    ("host", "url"),
    [("0.0.0.0", "http://127.0.0.1:30000"), ("::", "http://[::1]:30000"), ("fd00::2", "http://[fd00::2]:30000")],
)
def test_url_of_wildcard_and_ipv6_hosts(host: str, url: str) -> None:
    assert plan(one(host=host))[0].url == url


def test_python_explicit_env_installed_venv_and_fallback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert argv(one(python="/venvs/sgl/bin/python"))[0] == "/venvs/sgl/bin/python"
    assert argv(one())[0] == SGLANG_PY
    monkeypatch.setenv("TANDEM_SGLANG_PYTHON", "/opt/other/python")
    assert Settings().engine.sglang_interpreter == "/opt/other/python"
    monkeypatch.delenv("TANDEM_SGLANG_PYTHON")
    monkeypatch.setenv("TANDEM_SGLANG_VENV", str(tmp_path / "sglang"))
    assert Settings().engine.sglang_interpreter == sys.executable  # nothing installed there
    (tmp_path / "sglang" / "bin").mkdir(parents=True)
    (tmp_path / "sglang" / "bin" / "python").touch()
    assert Settings().engine.sglang_interpreter == str(
        tmp_path / "sglang" / "bin" / "python"
    )  # what setup_sglang.sh made


def test_env_is_added_after_gpu_assignment() -> None:
    launch = plan(one(env={"NCCL_DEBUG": "INFO"}))[0]
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "0", "NCCL_DEBUG": "INFO"}


def test_gpus_per_replica_and_in_order_disjoint_assignment() -> None:
    config = parse(
        {
            "gpus": 8,
            "groups": [
                group("a", replicas=2, tp_size=2, gpus_per_replica=2),
                group("cpu", device="cpu", base_port=31000),
                group("b", dp_size=3, base_port=32000),
            ],
        }
    )
    visible = [launch.env.get("CUDA_VISIBLE_DEVICES") for launch in plan(config)]
    assert visible == ["0,1", "2,3", None, "4,5,6"]


def test_router_options() -> None:
    data = pd_groups(package="smg", python="/venvs/smg/bin/python", host="0.0.0.0", port=9100)
    data["router"] |= {"policy": "least_load", "prometheus_port": 29100, "extra_args": ["--log-level", "debug"]}
    data["router"]["env"] = {"RUST_LOG": "info"}
    router = router_launch(parse(data))
    assert router is not None
    assert router.url == "http://127.0.0.1:9100" and router.env == {"RUST_LOG": "info"}
    assert router.argv[:4] == ("/venvs/smg/bin/python", "-m", "smg.launch_router", "--pd-disaggregation")
    assert router.argv[-10:-4] == ("--host", "0.0.0.0", "--port", "9100", "--policy", "least_load")
    assert router.argv[-4:] == ("--prometheus-port", "29100", "--log-level", "debug")


def test_router_default_bootstrap_port_is_sglangs() -> None:
    router = router_launch(parse(pd_groups()))
    assert router is not None
    assert router.argv[4:7] == ("--prefill", "http://127.0.0.1:30000", "8998")
    assert "--disaggregation-bootstrap-port" in plan(parse(pd_groups()))[0].argv


# --- validation rules -----------------------------------------------------------------------------------


def test_tp_times_dp_must_equal_gpus_per_replica() -> None:
    assert errors_of({"gpus": 8, "groups": [group(tp_size=2, dp_size=2, gpus_per_replica=2)]}) == [
        'group "g": gpus_per_replica: 2 != tp_size 2 x dp_size 2 = 4; SGLang uses exactly tp_size x dp_size GPUs'
    ]


def test_cuda_groups_need_the_node_gpu_count() -> None:
    assert errors_of({"groups": [group(tp_size=2)]}) == [
        'gpus: set the node\'s GPU count (top-level gpus = N); cuda groups "g" need 2'
    ]


def test_gpus_must_fit_the_node() -> None:
    data = {"gpus": 4, "groups": [group("a", replicas=2, tp_size=2), group("b", base_port=31000)]}
    assert errors_of(data) == ['gpus: the groups need 5 GPUs ("a" 2 x 2, "b" 1 x 1) but the node has 4']


def test_cpu_only_config_needs_no_gpu_count() -> None:
    assert plan(one(gpus=None, device="cpu"))[0].group == "g"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"role": "prefill", "transfer_backend": "nixl"}, "role: prefill groups need at least one decode group"),
        ({"role": "decode", "transfer_backend": "nixl"}, "role: decode groups need at least one prefill group"),
    ],
)
def test_prefill_and_decode_need_each_other(fields: dict[str, Any], message: str) -> None:
    assert errors_of({"gpus": 1, "groups": [group(**fields)], "router": {"port": 8100}}) == [message]


def test_prefill_and_decode_share_model_and_backend() -> None:
    data = pd_groups()
    data["groups"][1] |= {"model_path": "/models/other", "transfer_backend": "nixl"}
    assert errors_of(data) == [
        'model_path: prefill and decode groups must share one model_path ("p" /models/m, "d" /models/other)',
        'transfer_backend: prefill and decode groups must share one transfer_backend ("p" mooncake, "d" nixl)',
    ]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_disaggregated_groups_need_a_transfer_backend(role: str) -> None:
    data = pd_groups()
    del data["groups"][0 if role == "prefill" else 1]["transfer_backend"]
    assert errors_of(data) == [
        f'group "{role[0]}": transfer_backend: a {role} group needs a KV transfer backend (mooncake, nixl, ...)'
    ]


def test_disaggregation_needs_a_router() -> None:
    data = pd_groups()
    del data["router"]
    assert errors_of(data) == ["router: prefill/decode groups need a [router] section"]


def test_router_without_disaggregation_is_rejected() -> None:
    assert errors_of({"gpus": 1, "groups": [group()], "router": {"port": 8100}}) == [
        "router: only used for prefill/decode disaggregation; no group has role prefill or decode"
    ]


def test_regular_groups_cannot_join_a_disaggregated_config() -> None:
    data = pd_groups()
    data["gpus"] = 3
    data["groups"].append(group("r", base_port=32000))
    assert errors_of(data) == [
        "role: regular groups cannot be mixed with prefill/decode groups (the gateway uses the router only)"
    ]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"bootstrap_port": 9000}, "bootstrap_port: only prefill servers run a bootstrap server"),
        ({"transfer_backend": "mooncake"}, "transfer_backend: only used by prefill/decode groups (role is regular)"),
        ({"ib_device": "mlx5_0"}, "ib_device: only used by prefill/decode groups (role is regular)"),
    ],
)
def test_disaggregation_settings_need_a_role(fields: dict[str, Any], message: str) -> None:
    assert errors_of({"gpus": 1, "groups": [group(**fields)]}) == [f'group "g": {message}']


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp_size": 2}, "tp_size: tensor parallelism needs GPUs (device is cpu)"),
        ({"gpus_per_replica": 1}, "gpus_per_replica: a cpu group uses no GPUs"),
        (
            {"quantization": "fp8"},
            "quantization: fp8 needs GPUs (device is cpu): the CPU path has no quantized kernels",
        ),
        ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype: fp8_e4m3 needs GPUs (device is cpu); use auto or bf16"),
        ({"speculative": {"algorithm": "NGRAM"}}, "speculative: speculative decoding needs GPUs (device is cpu)"),
    ],
)
def test_cpu_rejects_gpu_only_options(fields: dict[str, Any], message: str) -> None:
    assert errors_of({"groups": [group(device="cpu", **fields)]}) == [f'group "g": {message}']


def test_cpu_rejects_disaggregation() -> None:
    data = pd_groups()
    data["groups"][0]["device"] = "cpu"
    assert errors_of(data) == ['group "p": role: prefill/decode disaggregation needs GPUs (device is cpu)']


@pytest.mark.parametrize("dtype", ["auto", "bf16", "bfloat16"])
def test_cpu_accepts_unquantized_kv_cache(dtype: str) -> None:
    assert "--kv-cache-dtype" in argv(one(gpus=None, device="cpu", kv_cache_dtype=dtype))


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_draft_model_algorithms_need_a_draft_model(algorithm: str) -> None:
    assert errors_of({"gpus": 1, "groups": [group(speculative={"algorithm": algorithm})]}) == [
        f'group "g": speculative.draft_model_path: {algorithm} needs a draft model'
    ]


def test_ngram_takes_no_draft_model() -> None:
    spec = {"algorithm": "NGRAM", "draft_model_path": "/models/draft"}
    assert errors_of({"gpus": 1, "groups": [group(speculative=spec)]}) == [
        'group "g": speculative.draft_model_path: NGRAM drafts from the context and takes no draft model'
    ]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dp_size": 1}, "dp_size: SGLang-only option; the tandem engine does not take it"),
        ({"quantization": "fp8"}, "quantization: SGLang-only option; the tandem engine does not take it"),
        ({"kv_cache_dtype": "auto"}, "kv_cache_dtype: SGLang-only option; the tandem engine does not take it"),
        ({"max_total_tokens": 1024}, "max_total_tokens: SGLang-only option; the tandem engine does not take it"),
        ({"mem_fraction_static": 0.5}, "mem_fraction_static: SGLang-only option; the tandem engine does not take it"),
        ({"context_length": 2048}, "context_length: SGLang-only option; the tandem engine does not take it"),
        (
            {"speculative": {"algorithm": "NGRAM"}},
            "speculative: SGLang-only option; the tandem engine does not take it",
        ),
        ({"tp_size": 2}, "tp_size: the tandem engine runs on one device; tensor parallelism is SGLang-only"),
        ({"gpus_per_replica": 2}, "gpus_per_replica: the tandem engine uses one GPU per replica"),
    ],
)
def test_tandem_engine_rejects_sglang_only_options(fields: dict[str, Any], message: str) -> None:
    found = errors_of({"gpus": 8, "groups": [group(engine="tandem", **fields)]})
    assert found[0] == f'group "g": {message}'


def test_tandem_engine_rejects_disaggregation() -> None:
    data = pd_groups()
    data["groups"][1]["engine"] = "tandem"
    assert errors_of(data) == [
        'group "d": transfer_backend: SGLang-only option; the tandem engine does not take it',
        'group "d": role: prefill/decode disaggregation is SGLang-only',
    ]


def test_ports_are_unique_across_groups_bootstraps_and_router() -> None:
    data = pd_groups()
    data["groups"][0] |= {"replicas": 2, "bootstrap_port": 31000}  # bootstraps on 31000 and 31001
    data["groups"][1] |= {"base_port": 30001}  # prefill replica 1's port
    data["router"] |= {"port": 31000, "prometheus_port": 31001}
    data["gpus"] = 3
    assert errors_of(data) == [
        'port 30001 is used by group "p" replica 1 and group "d" replica 0',
        'port 31000 is used by group "p" replica 0 bootstrap and the router',
        'port 31001 is used by group "p" replica 1 bootstrap and the router\'s prometheus_port',
    ]


def test_default_ports_of_two_groups_collide() -> None:
    data = {"gpus": 2, "groups": [group("a"), group("b")]}
    assert errors_of(data) == ['port 30000 is used by group "a" replica 0 and group "b" replica 0']


def test_ports_must_be_in_range() -> None:
    assert errors_of({"gpus": 2, "groups": [group(base_port=65535, replicas=2)]}) == [
        'port 65536 (group "g" replica 1) is out of range 1-65535'
    ]
    assert errors_of({"gpus": 1, "groups": [group(base_port=70000)]}) == [
        'group "g": base_port: Input should be less than or equal to 65535'
    ]


def test_group_names_are_unique() -> None:
    data = {"gpus": 2, "groups": [group("a"), group("a", base_port=31000)]}
    assert errors_of(data) == ['group "a": name: used by 2 groups']


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--port", "1"], "--port is set by tandem from base_port; remove it"),
        (["--tp-size=2"], "--tp-size is set by tandem from tp_size; remove it"),
        (["--model", "/x"], "--model is set by tandem from model_path; remove it"),
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size is set by tandem from tp_size; remove it"),
        (
            ["--mem-frac", "0.5"],
            "--mem-frac (abbreviates --mem-fraction-static) is set by tandem from mem_fraction_static; remove it",
        ),
        (["--disaggregation-mode", "prefill"], "--disaggregation-mode is set by tandem from role; remove it"),
    ],
)
def test_extra_args_cannot_repeat_builder_flags(extra: list[str], message: str) -> None:
    assert errors_of({"gpus": 1, "groups": [group(extra_args=extra)]}) == [f'group "g": extra_args: {message}']


def test_extra_args_on_cpu_cannot_repeat_cpu_flags() -> None:
    extra = ["--attention-backend", "triton", "--max-total-tokens", "1024"]
    assert errors_of({"groups": [group(device="cpu", extra_args=extra)]}) == [
        'group "g": extra_args: --attention-backend is set by tandem from device = cpu; remove it',
        'group "g": extra_args: --max-total-tokens is set by tandem from max_total_tokens; remove it',
    ]


def test_tandem_extra_args_cannot_repeat_its_flags() -> None:
    assert errors_of({"gpus": 1, "groups": [group(engine="tandem", extra_args=["--host", "0.0.0.0"])]}) == [
        'group "g": extra_args: --host is set by tandem from host; remove it'
    ]


def test_router_extra_args_cannot_repeat_its_flags() -> None:
    data = pd_groups(extra_args=["--prefill", "http://other:1"])
    assert errors_of(data) == ["router.extra_args: --prefill is set by tandem from the prefill groups; remove it"]


def test_env_cannot_set_cuda_visible_devices() -> None:
    assert errors_of({"gpus": 1, "groups": [group(env={"CUDA_VISIBLE_DEVICES": "3"})]}) == [
        'group "g": env: CUDA_VISIBLE_DEVICES is assigned from gpus; do not set it'
    ]


@pytest.mark.parametrize(
    ("package", "policy", "ok"), [("sglang_router", "least_load", False), ("smg", "least_load", True)]
)
def test_router_policy_matches_its_package(package: str, policy: str, ok: bool) -> None:
    data = pd_groups(package=package, policy=policy)
    if ok:
        assert parse(data).router is not None
    else:
        assert errors_of(data) == [
            "router.policy: 'least_load' is not one of sglang_router's random, round_robin, cache_aware,"
            " power_of_two, manual"
        ]


def test_model_paths_must_exist(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    spec = {"algorithm": "EAGLE", "draft_model_path": str(tmp_path / "missing")}
    data = {"gpus": 1, "groups": [group(model_path=str(model), speculative=spec)]}
    assert errors_of(data, check_paths=True) == [
        f'group "g": speculative.draft_model_path: {tmp_path / "missing"} is not a directory'
        " (hub ids are not downloaded; point at a local folder)"
    ]
    spec["draft_model_path"] = str(model)
    assert parse(data, check_paths=True).groups[0].model_path == str(model)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp": 2}, "tp: Extra inputs are not permitted"),
        ({"replicas": 0}, "replicas: Input should be greater than or equal to 1"),
        ({"device": "xpu"}, "device: Input should be 'cuda' or 'cpu'"),
        ({"engine": "vllm"}, "engine: Input should be 'sglang' or 'tandem'"),
        ({"role": "both"}, "role: Input should be 'regular', 'prefill' or 'decode'"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static: Input should be less than 1"),
        (
            {"speculative": {"algorithm": "MEDUSA"}},
            "speculative.algorithm: Input should be 'EAGLE', 'EAGLE3', 'NEXTN', 'STANDALONE' or 'NGRAM'",
        ),
        (
            {"transfer_backend": "rdma"},
            "transfer_backend: Input should be 'mooncake', 'nixl', 'ascend', 'fake', 'mori' or 'mooncake_tcp'",
        ),
        (
            {"kv_cache_dtype": "int8"},
            "kv_cache_dtype: Input should be 'auto', 'fp8_e5m2', 'fp8_e4m3', 'mxfp8', 'bf16', 'bfloat16', 'nvfp4'"
            " or 'fp4_mx_block16'",
        ),
    ],
)
def test_schema_errors_name_group_and_field(fields: dict[str, Any], message: str) -> None:
    assert errors_of({"gpus": 1, "groups": [group(**fields)]}) == [f'group "g": {message}']


def test_unknown_quantization_lists_sglangs_methods() -> None:
    [message] = errors_of({"gpus": 1, "groups": [group(quantization="int3")]})
    assert message.startswith(
        "group \"g\": quantization: Value error, unknown method 'int3'; SGLang 0.5.23 knows awq, fp8,"
    )


def test_all_errors_are_reported_at_once() -> None:
    data = {
        "gpus": 1,
        "groups": [
            group("a", tp_size=2, gpus_per_replica=3, extra_args=["--port", "1"], colour="red"),
            {"model_path": "/models/m", "base_port": 31000},
            group("c", device="cpu", quantization="fp8", base_port=30000),
        ],
        "router": {"port": 0},
    }
    assert errors_of(data) == [
        'group "a": colour: Extra inputs are not permitted',
        "groups[1]: name: Field required",
        "router.port: Input should be greater than or equal to 1",
        'group "a": gpus_per_replica: 3 != tp_size 2 x dp_size 1 = 2; SGLang uses exactly tp_size x dp_size GPUs',
        'group "a": extra_args: --port is set by tandem from base_port; remove it',
        'group "c": quantization: fp8 needs GPUs (device is cpu): the CPU path has no quantized kernels',
        'gpus: the groups need 3 GPUs ("a" 1 x 3) but the node has 1',
        'port 30000 is used by group "a" replica 0 and group "c" replica 0',
    ]


def test_error_message_lists_every_problem() -> None:
    with pytest.raises(LaunchConfigError) as info:
        parse({"groups": []})
    assert str(info.value) == (
        "1 problem(s) in the engine groups config:\n  - groups: List should have at least 1 item after validation, not 0"
    )
    assert isinstance(info.value, ValueError)


# --- loading, the shipped example, the builders' flag tables ------------------------------------------


def test_load_reports_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(LaunchConfigError, match=r"cannot read .*missing\.toml: No such file or directory"):
        load_launch_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[groups]\n")
    with pytest.raises(LaunchConfigError, match=r"bad\.toml is not valid TOML"):
        load_launch_config(bad)


def test_shipped_example_is_valid_and_disaggregated() -> None:
    config = load_launch_config(REPO / "examples" / "engine-groups.toml", check_paths=False)
    assert [launch.role for launch in plan(config)] == ["prefill", "decode", "decode"]
    assert serving_urls(config) == ["http://127.0.0.1:8100"]


def test_every_builder_flag_is_protected_from_extra_args() -> None:
    spec = {"algorithm": "EAGLE", "draft_model_path": "/d", "num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2}
    full = {"quantization": "fp8", "kv_cache_dtype": "auto", "context_length": 1, "max_total_tokens": 1}
    full |= {"mem_fraction_static": 0.5, "served_model_name": "s", "weight_version": "v", "dp_size": 1}
    data = pd_groups()
    data["groups"][0] |= full | {"speculative": spec, "ib_device": "mlx5_0"}
    data["groups"].append(group("t", engine="tandem", weight_version="v", base_port=32000))
    config = LaunchConfig.model_validate(data | {"gpus": 3})  # schema only: mixing roles is fine for this census
    launches = plan(config)
    router = router_launch(config)
    assert router is not None
    for launch, owned in [(launches[0], SGLANG_FLAGS), (launches[2], TANDEM_FLAGS), (router, ROUTER_FLAGS)]:
        assert {arg for arg in launch.argv if arg.startswith("--")} <= set(owned)


# --- the CLI --------------------------------------------------------------------------------------------


def test_cli_plan_prints_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_SGLANG_PYTHON", SGLANG_PY)  # the settings name the interpreter
    path = tmp_path / "groups.toml"
    path.write_text('gpus = 1\n[[groups]]\nname = "g"\nmodel_path = "/models/my model"\nenv = { A = "x y" }\n')
    result = CliRunner().invoke(engines_app, ["plan", str(path), "--no-check-paths"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        '# group "g" replica 0 (regular) -> http://127.0.0.1:30000',
        f"CUDA_VISIBLE_DEVICES=0 A='x y' {SGLANG_PY} -m sglang.launch_server --model-path '/models/my model'"
        " --host 127.0.0.1 --port 30000 --tp-size 1 --grammar-backend llguidance"
        " --constrained-json-disable-any-whitespace",
        "# 1 server(s); the gateway routes over http://127.0.0.1:30000",
    ]


def test_cli_plan_prints_the_router(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        engines_app, ["plan", str(REPO / "examples" / "engine-groups.toml"), "--no-check-paths"]
    )
    assert result.exit_code == 0, result.output
    assert "# router -> http://127.0.0.1:8100" in result.output.splitlines()
    assert result.output.splitlines()[-1] == "# 3 server(s) and a router; the gateway routes over http://127.0.0.1:8100"


def test_cli_plan_lists_all_errors_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "groups.toml"
    path.write_text('[[groups]]\nname = "g"\nmodel_path = "/nowhere"\ntp_size = 2\n')
    result = CliRunner().invoke(engines_app, ["plan", str(path)])
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        "2 problem(s) in the engine groups config:",
        '  - group "g": model_path: /nowhere is not a directory (hub ids are not downloaded; point at a local folder)',
        '  - gpus: set the node\'s GPU count (top-level gpus = N); cuda groups "g" need 2',
    ]
