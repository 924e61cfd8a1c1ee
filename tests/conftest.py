"""Shared test setup: `gpu` tests run only where torch sees a CUDA or ROCm device."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Tests never reach a hub: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Each test process gets its own datasets cache: a config with `overwrite_cache: true` (force_redownload) would
# otherwise delete the cache folder another xdist worker is writing the same demo file's dataset into.
_DATASETS_CACHE = tempfile.mkdtemp(prefix=f"tiletune-datasets-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE
atexit.register(shutil.rmtree, _DATASETS_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm GPU; torch sees none (on a machine with one, its torch: "
                                       "pip install torch --index-url https://download.pytorch.org/whl/cu128, or rocm6.4)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO.parent / "shared" / "compat" / "llamafactory"


@pytest.fixture(scope="session")
def compat_dir() -> Path:
    """LLaMA-Factory's shipped example configs and demo data (shared/compat/llamafactory beside the repo)."""
    if not COMPAT.is_dir():
        commit = (REPO / "tests" / "train" / "compat" / "SOURCE_COMMIT").read_text().split()[0]
        pytest.skip(f"LLaMA-Factory's example configs and data not found at {COMPAT}: git clone "
                    f"https://github.com/hiyouga/LLaMA-Factory {COMPAT} && git -C {COMPAT} checkout {commit}")
    return COMPAT


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The demo model's folder: its tokenizer has the Llama-3 and ChatML special tokens."""
    return REPO / "examples" / "tiny-llama"


def _random_init_model(path: Path, tokenizer_dir: Path, config_class, model_class) -> Path:
    """A randomly initialised 2-layer `model_class` with the demo tokenizer, saved in `path`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(path)
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A randomly initialised 2-layer Llama with the demo tokenizer: fast enough to train in tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _random_init_model(tmp_path_factory.mktemp("tiny-model"), tokenizer_dir, LlamaConfig, LlamaForCausalLM)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """The same shape as a Qwen3 (RMSNorms on q and k in attention)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _random_init_model(tmp_path_factory.mktemp("tiny-qwen3"), tokenizer_dir, Qwen3Config, Qwen3ForCausalLM)


@pytest.fixture
def demo_tokenizer(tokenizer_dir):
    """A fresh copy of the demo tokenizer (templates may add tokens to it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, worker_id) -> Path:
    """The README's main job, `tiletune train examples/demo.yaml` from the repository root (train, predict, plot;
    about a minute on 2 cores), run once per test run into a folder of its own: under pytest-xdist the first
    worker to ask runs it in the run's shared temp dir while the others wait on a lock, then all read it."""
    from click.testing import CliRunner
    from filelock import FileLock

    from tiletune.cli import main

    root = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    out = root / "demo-run"
    with FileLock(str(root / "demo-run.lock")):
        if not (out / "predict_results.json").is_file():
            cwd = os.getcwd()
            os.chdir(REPO)  # the demo names its files relative to the repository root
            try:
                result = CliRunner().invoke(main, ["train", str(REPO / "examples" / "demo.yaml"), f"output_dir={out}"])
            finally:
                os.chdir(cwd)
            assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="session")
def demo_adapter(demo_run) -> Path:
    """The README demo's LoRA adapter (the folder `demo_run` trained)."""
    return demo_run


@pytest.fixture
def no_kernel_runs(monkeypatch):
    """Every implementation but the PyTorch references unavailable ("no GPU here"), as on a machine without a GPU."""
    import dataclasses

    from tiletune.kernels import registry

    registry.load_ops()
    for impls in registry._impls.values():
        for name, impl in impls.items():
            if name != registry.REFERENCE:
                monkeypatch.setitem(impls, name, dataclasses.replace(impl, unavailable=lambda: "no GPU here"))
