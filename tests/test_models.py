"""Model resolution, the SmolLM2 conversion cache and the tiny test model."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.models import BUILTIN_MODELS, BuiltinModel, build_cached, resolve_model
from tests.fixtures.tiny_model import build_tiny_model, perturb_weights, tiny_model_path

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLES = [
    "Hello world, it's a test. Don't panic!",
    "café naïve Zürich déjà vu; Привет мир; 你好\uff0c世界; こんにちは",
    "emoji 🙂🚀👩‍👩‍👧 flags 🇫🇷 and ✓ → ½",
    'def add(a: int, b: int) -> int:\n    return a + b  # sum\n\tprint(f"{a!r}")\r\n',
    "   leading and trailing spaces   \n\n\n12345 + 678 = 13023",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_model_path()


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_tiny_model_is_byte_for_byte_deterministic(tiny: Path, tmp_path: Path) -> None:
    here = build_tiny_model(tmp_path / "here")
    # A second process with another hash seed catches any dependence on set or dict order.
    script = "import sys; from pathlib import Path; from tests.fixtures.tiny_model import build_tiny_model; "
    script += "build_tiny_model(Path(sys.argv[1]))"
    env = {**_subprocess_env(), "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "there")], env=env, check=True, cwd=REPO_ROOT)
    assert _digests(here) == _digests(tmp_path / "there") == _digests(tiny)
    assert set(_digests(here)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_tiny_model_config_loads_in_transformers_and_sglang_shape(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is False
    assert (config["vocab_size"], config["eos_token_id"], config["pad_token_id"]) == (2048, 2, 0)
    tokenizer_config = json.loads((tiny / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["additional_special_tokens"] == ["<|im_start|>", "<|im_end|>"]
    assert "add_generation_prompt" in tokenizer_config["chat_template"]


def test_auto_tokenizer_gives_the_trained_ids(tiny: Path) -> None:
    trained = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(tiny)
    assert len(auto) == trained.get_vocab_size() == 2048
    assert [auto.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert (auto.eos_token, auto.pad_token, auto.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    for text in SAMPLES:
        ids = auto(text)["input_ids"]
        assert ids == trained.encode(text).ids, text
        assert auto.decode(ids) == text


def test_chat_template_honours_add_generation_prompt(tiny: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    turns = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == turns
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == turns + "<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == tokenizer(prompt)["input_ids"]
    assert ids[:1] == [1] and ids.count(2) == 2


def test_tiny_model_greedy_generate_is_repeatable(tiny: Path, one_thread: None) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.dtype == torch.bfloat16
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    first = model.generate(**inputs, do_sample=False, max_new_tokens=16)
    second = model.generate(**inputs, do_sample=False, max_new_tokens=16)
    assert torch.equal(first, second)
    new_tokens = first[0, inputs["input_ids"].shape[1] :]
    assert 1 <= len(new_tokens) <= 16
    assert int(new_tokens.max()) < len(tokenizer)


def test_perturb_weights_adds_seeded_noise_to_2d_weights_only(tiny: Path, tmp_path: Path) -> None:
    perturbed = perturb_weights(tiny, tmp_path / "a")
    assert _digests(perturb_weights(tiny, tmp_path / "b")) == _digests(perturbed)
    assert _digests(perturb_weights(tiny, tmp_path / "c", seed=2)) != _digests(perturbed)
    original, noisy = load_file(tiny / "model.safetensors"), load_file(perturbed / "model.safetensors")
    assert original.keys() == noisy.keys()
    for name, weight in original.items():
        assert noisy[name].dtype == weight.dtype
        if weight.dim() == 2:
            assert 0.04 < float((noisy[name].float() - weight.float()).std()) < 0.06, name
        else:
            assert torch.equal(noisy[name], weight), name
    digests, tiny_digests = _digests(perturbed), _digests(tiny)
    assert {k for k in digests if digests[k] != tiny_digests[k]} == {"model.safetensors"}


def test_resolve_model_accepts_a_local_model_folder(tiny: Path) -> None:
    assert resolve_model(str(tiny), Path("/nonexistent-cache")) == tiny


def test_resolve_model_rejects_a_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=f"{missing}.*does not exist.*smollm2-135m-instruct"):
        resolve_model(str(missing), tmp_path)


@pytest.mark.parametrize("make", [lambda p: p.mkdir(), lambda p: p.write_text("{}")], ids=["folder", "file"])
def test_resolve_model_rejects_a_non_model_path(tmp_path: Path, make: object) -> None:
    path = tmp_path / "not-a-model"
    make(path)  # type: ignore[operator]
    with pytest.raises(ValueError, match=f"{path} is not a Hugging Face model folder"):
        resolve_model(str(path), tmp_path)


def test_builtin_model_without_its_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absent = BuiltinModel(key="absent", package="tandem_no_such_package", gguf_file="x.gguf", install_hint="pip x")
    monkeypatch.setitem(BUILTIN_MODELS, "absent", absent)
    with pytest.raises(RuntimeError, match="tandem_no_such_package: pip x"):
        resolve_model("absent", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".absent.lock"]


def test_build_cached_leaves_nothing_behind_when_the_build_fails(tmp_path: Path) -> None:
    def crash(out: Path) -> None:
        (out / "half-written").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_cached(tmp_path / "model", crash)
    assert [p.name for p in tmp_path.iterdir()] == [".model.lock"]
    built = build_cached(tmp_path / "model", lambda out: (out / "ok").write_text("y"))
    assert [p.name for p in built.iterdir()] == ["ok"]


def test_build_cached_builds_once_across_processes(tmp_path: Path) -> None:
    script = """
import sys, time
from pathlib import Path
from tandem.models import build_cached

def build(out: Path) -> None:
    with open(sys.argv[2], "a") as log:
        log.write("built\\n")
    time.sleep(0.5)
    (out / "done").write_text("1")

build_cached(Path(sys.argv[1]), build)
"""
    args = [sys.executable, "-c", script, str(tmp_path / "model"), str(tmp_path / "log")]
    procs = [subprocess.Popen(args, env=_subprocess_env(), cwd=REPO_ROOT) for _ in range(3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert (tmp_path / "log").read_text() == "built\n"
    assert (tmp_path / "model" / "done").read_text() == "1"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    cache = tmp_path_factory.mktemp("model-cache")
    started = time.perf_counter()
    path = resolve_model("smollm2-135m-instruct", cache)
    return path, time.perf_counter() - started


@pytest.mark.slow
def test_smollm2_conversion_is_cached(smollm2: tuple[Path, float]) -> None:
    path, first = smollm2
    started = time.perf_counter()
    assert resolve_model("smollm2-135m-instruct", path.parent) == path
    again = time.perf_counter() - started
    print(f"smollm2 conversion {first:.1f} s, cached resolve {again * 1000:.2f} ms")
    assert again < 0.5
    assert sorted(p.name for p in path.parent.iterdir()) == [".smollm2-135m-instruct.lock", path.name]
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"


@pytest.mark.slow
def test_smollm2_tokenizer_matches_the_gguf_one(smollm2: tuple[Path, float]) -> None:
    path, _ = smollm2
    builtin = BUILTIN_MODELS["smollm2-135m-instruct"]
    spec = importlib.util.find_spec(builtin.package)
    assert spec is not None and spec.submodule_search_locations
    gguf_dir = Path(spec.submodule_search_locations[0])
    original = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=builtin.gguf_file)
    converted = AutoTokenizer.from_pretrained(path)
    for text in SAMPLES:
        assert converted(text)["input_ids"] == original(text)["input_ids"], text
    messages = [{"role": "user", "content": "Hi"}]
    prompt = converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_answers_a_chat_prompt(smollm2: tuple[Path, float]) -> None:
    path, _ = smollm2
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    print(f"smollm2 reload from the converted folder {time.perf_counter() - started:.2f} s")
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    output = model.generate(**inputs, do_sample=False, max_new_tokens=24)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
