"""The library on a CUDA GPU: same numbers as on CPU, conversion in place on the GPU, bf16 training, save/load.

Skipped where torch sees no GPU (CI). Run on a GPU machine with ``python -m pytest tests/test_cuda.py``.
The model is a randomly initialized BERT of MiniLM's shape (hidden 384, 12 heads of 32), so these tests need
neither the packaged checkpoint nor a network.
"""

import copy

import pytest
import torch
from conftest import with_cache
from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

import collab_attn  # noqa: F401  (registers the Auto classes)
from collab_attn import CollaborativeAttention, MultiHeadAttention, reparametrize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU = "cuda"


@pytest.fixture(autouse=True)
def exact_float32():
    """TF32 would round float32 products to 10 mantissa bits and make CPU/GPU comparisons loose."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def minilm_shaped_bert(num_labels: int = 2) -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_size=384, num_hidden_layers=3, num_attention_heads=12,
                        intermediate_size=1536, num_labels=num_labels)
    return BertForSequenceClassification(config).eval()


def padded_batch(device: str, batch: int = 4, seq: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 1000, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[1, 25:] = 0
    attention_mask[3, 10:] = 0
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


@pytest.mark.parametrize(
    "module_name, need_weights",
    [("concat", True), ("collab", True), ("collab", False), ("collab-tucker", True), ("collab-tucker", False)],
)
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_on_gpu_matches_cpu(module_name, need_weights, is_causal):
    torch.manual_seed(0)
    if module_name == "concat":
        layer = MultiHeadAttention(384, 12)
    else:
        layer = CollaborativeAttention(384, 12, 128, mixing_init="random",
                                       tucker_core_size=4 if module_name == "collab-tucker" else None)
    layer.eval()
    x, memory = torch.randn(3, 50, 384), torch.randn(3, 70, 384)
    mask = torch.ones(3, 50, dtype=torch.long)
    mask[0, 30:] = 0
    with torch.no_grad():
        on_cpu, weights_cpu = layer(x, attention_mask=mask, is_causal=is_causal, need_weights=need_weights)
        cross_cpu, _ = layer(x, key_value_states=memory)
        layer.to(GPU)
        on_gpu, weights_gpu = layer(x.to(GPU), attention_mask=mask.to(GPU), is_causal=is_causal,
                                    need_weights=need_weights)
        cross_gpu, _ = layer(x.to(GPU), key_value_states=memory.to(GPU))
    assert on_gpu.device.type == "cuda"
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cross_gpu.cpu(), cross_cpu, atol=1e-5, rtol=1e-4)
    if need_weights:
        torch.testing.assert_close(weights_gpu.cpu(), weights_cpu, atol=1e-6, rtol=1e-4)


def test_full_rank_conversion_on_gpu_is_exact_and_stays_on_gpu():
    model = minilm_shaped_bert().to(GPU)
    batch = padded_batch(GPU)
    with torch.no_grad():
        before = model(**batch).logits
    reparametrize(model, rank=384, progress=False)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    with torch.no_grad():
        after = model(**batch).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["cp", "tucker"])
def test_low_rank_conversion_on_gpu_decomposed_on_the_cpu_matches_conversion_on_cpu(method):
    """``device="cpu"``: the GPU model's decomposition runs on the CPU, from the same weights, so its factors and
    errors are the CPU conversion's exactly; the converted GPU model must compute what the CPU one does. (The CPU
    side of named devices: tests/test_device_twins.py.)"""
    on_cpu, on_gpu = minilm_shaped_bert(), minilm_shaped_bert().to(GPU)
    report_cpu = reparametrize(on_cpu, rank=96, method=method, progress=False)
    report_gpu = reparametrize(on_gpu, rank=96, method=method, progress=False, device="cpu")
    assert [layer.relative_error for layer in report_gpu.layers] == [
        layer.relative_error for layer in report_cpu.layers
    ]
    assert {p.device.type for p in on_gpu.parameters()} == {"cuda"}
    with torch.no_grad():
        logits_gpu = on_gpu(**padded_batch(GPU)).logits
        logits_cpu = on_cpu(**padded_batch("cpu")).logits
    torch.testing.assert_close(logits_gpu.cpu(), logits_cpu, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["cp", "tucker"])
@pytest.mark.parametrize("where", ["model on the gpu", "model on the cpu, device=cuda"])
def test_low_rank_decomposition_on_the_gpu_fits_as_well_as_on_the_cpu(method, where):
    """The decomposition runs on the GPU (``device=None`` for a GPU model: where the model is; ``device="cuda"`` for
    a CPU model, which stays on the CPU). Its float32 products are summed in another order than on the CPU, and the
    ALS iterations magnify such differences (tests/test_device_twins.py: 1e-7 in the input moves the errors by up to
    1e-2 of their value after 100 iterations), so it fits as well as the CPU, not bit for bit; the converted model
    computes on its device what its weights compute on the CPU."""
    on_cpu = minilm_shaped_bert()
    report_cpu = reparametrize(on_cpu, rank=96, method=method, progress=False)
    if where == "model on the gpu":
        converted = minilm_shaped_bert().to(GPU)
        report = reparametrize(converted, rank=96, method=method, progress=False)
    else:
        converted = minilm_shaped_bert()
        report = reparametrize(converted, rank=96, method=method, progress=False, device="cuda")
        assert {p.device.type for p in converted.parameters()} == {"cpu"}
    assert [layer.rank for layer in report.layers] == [layer.rank for layer in report_cpu.layers]
    for got, expected in zip(report.layers, report_cpu.layers):
        assert got.relative_error == pytest.approx(expected.relative_error, rel=2e-2), got.name
    device = next(converted.parameters()).device
    with torch.no_grad():
        logits = converted(**padded_batch(device.type)).logits
        on_the_cpu = copy.deepcopy(converted).cpu()(**padded_batch("cpu")).logits
    torch.testing.assert_close(logits.cpu(), on_the_cpu, atol=1e-5, rtol=1e-4)


def test_converted_model_trains_in_bfloat16_autocast():
    model = minilm_shaped_bert().to(GPU)
    reparametrize(model, rank=96, progress=False)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = padded_batch(GPU, batch=16)
    labels = torch.arange(16, device=GPU) % 2
    losses = []
    for _ in range(30):
        with torch.autocast(GPU, dtype=torch.bfloat16):
            loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        mixing_grads = [m.mixing.grad for m in model.modules() if isinstance(m, CollaborativeAttention)]
        assert mixing_grads and all(g is not None and torch.isfinite(g).all() for g in mixing_grads)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses  # 16 fixed examples: the model must fit them


def test_converted_gpu_model_saves_and_loads_onto_gpu(tmp_path):
    model = minilm_shaped_bert().to(GPU)
    reparametrize(model, rank=96, progress=False)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path, device_map=GPU).eval()
    assert type(loaded).__name__ == "CollabBertForSequenceClassification"
    assert {p.device.type for p in loaded.parameters()} == {"cuda"}
    batch = padded_batch(GPU)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)


def test_half_precision_model_converts_in_its_own_dtype():
    model = minilm_shaped_bert().to(GPU)
    batch = padded_batch(GPU)
    with torch.no_grad():
        before = model(**batch).logits
    model.half()
    reparametrize(model, rank=384, progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    with torch.no_grad():
        after = model(**batch).logits.float()
    torch.testing.assert_close(after, before, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("method, rank", [("cp", 96), ("svd", 96)])
def test_a_converted_gpt2_decodes_on_the_gpu_as_on_the_cpu(method, rank):
    """GPT-2 converted on the GPU: cached decoding equals recomputation, and greedy generation with the cache gives
    the tokens it gives without the cache and on the CPU."""
    from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config

    torch.manual_seed(0)
    config = GPT2Config(n_embd=384, n_layer=2, n_head=12, vocab_size=1000, n_positions=128, pad_token_id=0)
    cpu = AutoModelForCausalLM.from_config(config).eval()
    gpu = copy.deepcopy(cpu).to(GPU)
    options = {"n_iter_max": 5} if method == "cp" else {}
    for model in (cpu, gpu):
        reparametrize(model, rank, method, progress=False, **options)
    ids = torch.randint(5, 1000, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = gpu(ids.to(GPU), use_cache=False).logits
        cache = with_cache(gpu, DynamicCache())  # under the name this transformers' forward takes it by
        pieces = [gpu(ids[:, :8].to(GPU), use_cache=True, **cache).logits]
        pieces += [gpu(ids[:, i:i + 1].to(GPU), use_cache=True, **cache).logits for i in range(8, 12)]
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(full.cpu(), cpu(ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)
    settings = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    cached = gpu.generate(ids.to(GPU), use_cache=True, **settings)
    assert torch.equal(cached, gpu.generate(ids.to(GPU), use_cache=False, **settings))
    assert torch.equal(cached.cpu(), cpu.generate(ids, **settings))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_key_head_dim", [4, 8, 16])
def test_narrow_query_key_heads_train_on_the_gpu(dtype, query_key_head_dim):
    """Concatenated heads whose queries and keys are narrower than their values (SVD-truncated heads, small-key
    models trained from scratch): forward and backward on the GPU in float32 and bfloat16, as on the CPU."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(128, 4, query_key_head_dim=query_key_head_dim)
    x = torch.randn(3, 20, 128)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 15:] = 0
    expected, _ = layer(x, attention_mask=mask, is_causal=True)
    gpu = copy.deepcopy(layer).to(GPU).train()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out, _ = gpu(x.to(GPU), attention_mask=mask.to(GPU), is_causal=True)
        out.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpu.parameters())
    gpu.eval()
    with torch.no_grad():
        got, _ = gpu(x.to(GPU), attention_mask=mask.to(GPU), is_causal=True)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_distillation_trains_on_the_gpu_with_a_cpu_teacher_moved_there(tmp_path):
    """refit=distill's trainer on a GPU: the teacher, handed over on the CPU, runs on the student's device, the
    loss terms are finite, and the teacher's weights do not move."""
    import transformers

    from collab_attn.distillation import DistillationTrainer, DistillSettings

    teacher = minilm_shaped_bert()
    teacher.config._attn_implementation = "eager"  # its attention maps are needed
    student = copy.deepcopy(teacher)
    reparametrize(student, 64, method="cp", n_iter_max=3, progress=False)
    data = [{**{k: v[i] for k, v in padded_batch("cpu").items()}, "labels": torch.tensor(i % 2)} for i in range(4)]
    args = transformers.TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                                          report_to=[], bf16=True)
    settings = DistillSettings(alpha=0.5, temperature=2.0, hidden_weight=0.1, attention_weight=0.1)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    trainer = DistillationTrainer(model=student, args=args, train_dataset=data, teacher=teacher, distill=settings,
                                  regression=False)
    trainer.train()
    assert next(trainer.teacher.parameters()).device.type == "cuda"
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs and all(torch.isfinite(torch.tensor(entry["distill_attention_loss"])) for entry in logs)
    assert all(torch.equal(before[k], v.cpu()) for k, v in trainer.teacher.state_dict().items())
