"""The bf16 projections on packed tiles (engines/rollout/cpu_bf16_linear.py, cpu_bf16_linear.c): F.linear's result to
one bf16 rounding per output (mostly bit for bit) on shapes whose rows, k and columns are not whole tiles, with and
without a bias, past MAX_ROWS too; a row's result does not depend on the other rows of a call; a re-pack into the
old tiles gives the new weight's products; the bf16 native decoder uses it by default where it runs, and its greedy
tokens are the oneDNN-packed decoder's; a routed-experts layer's experts as one C call on these tiles
(cpu_bf16_step.routed_experts) are the bits of moe.py's dispatch over the same kernel; a dense model's whole bf16
decode step as one C call (cpu_bf16_step.step) gives the tokens and log-probs of its steps as Python-level calls
(cpu_bf16_step.layers), bit for bit. Each test runs once per kind of the kernel that runs here (AMX tiles, AVX512-BF16
dot products); on CPUs without bf16 units these tests skip and the bf16 decoder keeps oneDNN or F.linear
(test_rollout_onednn.py)."""

from __future__ import annotations

import dataclasses
import glob
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_rollout_engines import make_prompts, write_model

from hybridflow.engines.rollout import SamplingParams, cpu_bf16_linear, cpu_bf16_step, create_rollout_engine
from hybridflow.engines.tiny import SIZES, write_tiny_model

# a kernel that builds here but fails its check against F.linear fails the tests below (its kind is still run), it
# does not skip them
pytestmark = pytest.mark.skipif(not cpu_bf16_linear.built_kinds(), reason="no AMX or AVX512-BF16 on this CPU (or no "
                                "compiler that knows them): the bf16 decoder keeps oneDNN's packed product")


@pytest.fixture(scope="module", autouse=True, params=cpu_bf16_linear.built_kinds() or ["none"])
def kind(request):
    """Each kind of the kernel that runs here (AMX hosts have both), as the one the decoders choose."""
    real = cpu_bf16_linear.load
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_bf16_linear, "load", lambda kind=None: real(kind or request.param))
        yield request.param


@pytest.fixture(scope="module")
def kernel(kind):
    kernel = cpu_bf16_linear.load(kind)
    assert kernel is not None, f"the {kind} kernel builds here but disagrees with F.linear (its check, logged)"
    assert kernel.kind == kind
    return kernel


def _within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """got and want (bf16) equal, or one bf16 step (2^-7 relative) apart where their fp32 sums round differently."""
    got, want = got.float(), want.float()
    assert torch.all((got - want).abs() <= want.abs() * 2**-7 + 1e-6), (got - want).abs().max()
    assert (got != want).float().mean() < 1e-3, int((got != want).sum())


# 10 and 12 rows: a second pass of 4 and 6 rows under the dot products' column blocks (it fetches the next blocks)
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (5, 40, 72), (10, 200, 96), (12, 72, 64), (16, 288, 512),
                                   (33, 100, 96), (64, 1024, 512),
                                   (300, 48, 64)])  # 300 rows: past MAX_ROWS, F.linear on the weight itself
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_f_linears_to_one_rounding(kernel, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(3, m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = kernel.linear(x, kernel.pack(w), b)
    assert got.shape == (3, m, n) and got.dtype == torch.bfloat16
    _within_one_rounding(got, F.linear(x, w, b))


def test_a_rows_result_does_not_depend_on_the_other_rows(kernel):
    """Also: the dot products' tall blocks (8 to 48 rows: 16 rows under one column block) give the bits of their 6 x 4
    blocks (the 70 rows together)."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(200, 160, generator=g).bfloat16(), torch.randn(70, 160, generator=g).bfloat16()
    packed = kernel.pack(w)
    together = kernel.linear(x, packed, None)
    for rows in (slice(0, 1), slice(3, 20), slice(10, 42), slice(6, 70), slice(0, 8), slice(2, 50), slice(1, 50),
                 slice(5, 21)):
        assert torch.equal(kernel.linear(x[rows], packed, None), together[rows])


@pytest.mark.parametrize("threads", [1, 3])
def test_the_product_does_not_depend_on_the_thread_count(kernel, threads):
    """The threads split the columns (AMX: units of 64; the dot products: equal runs of 16), each column's sums k in
    order: 1 and 3 threads give the 2 threads' bits, 3 with a run of blocks left over."""
    g = torch.Generator().manual_seed(threads)
    w, x = torch.randn(21 * 16 + 5, 96, generator=g).bfloat16(), torch.randn(13, 96, generator=g).bfloat16()
    packed, before = kernel.pack(w), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernel.linear(x, packed, None)
        torch.set_num_threads(threads)
        assert torch.equal(kernel.linear(x, packed, None), two)
    finally:
        torch.set_num_threads(before)


def test_a_repack_writes_the_old_tiles_and_gives_the_new_weights_products(kernel):
    g = torch.Generator().manual_seed(3)
    old, new = (torch.randn(64, 96, generator=g).bfloat16() for _ in range(2))
    x = torch.randn(8, 96, generator=g).bfloat16()
    packed = kernel.pack(old)
    tiles = packed.tiles.data_ptr()
    assert kernel.pack(new, out=packed) is packed and packed.tiles.data_ptr() == tiles
    _within_one_rounding(kernel.linear(x, packed, None), F.linear(x, new))


def test_a_mismatched_input_is_a_clear_error(kernel):
    packed = kernel.pack(torch.randn(32, 64).bfloat16())
    with pytest.raises(ValueError, match="packed weight of 32 x 64"):
        kernel.linear(torch.randn(4, 48).bfloat16(), packed, None)
    with pytest.raises(ValueError, match="float32"):
        kernel.linear(torch.randn(4, 64), packed, None)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
def test_the_bf16_decoder_uses_it_and_follows_the_onednn_decoder(tmp_path, arch, kind):
    path = write_model(tmp_path / arch, arch, seed=3, tie=False)  # untied head: the packed lm_head is used
    tiles = create_rollout_engine("native", path, dtype="bf16", num_threads=2, prepack=True)
    onednn = create_rollout_engine("native", path, dtype="bf16", num_threads=2, prepack=True, linear_kernel=False)
    assert tiles.model.matmul == "bf16_tiles" and onednn.model.matmul == "onednn"
    assert tiles.model.bf16_kernel.kind == kind
    prompts = make_prompts(tiles.tokenizer)
    params = SamplingParams(greedy=True, max_new_tokens=16)
    a, b = tiles.generate(prompts, params), onednn.generate(prompts, params)
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=2e-2, rtol=0)


def _count_calls(monkeypatch, name: str) -> dict:
    """Replaces cpu_bf16_step.<name> by itself counting the calls that applied (returned something): {"C": count}."""
    calls, real = {"C": 0}, getattr(cpu_bf16_step, name)

    def counted(*args):
        out = real(*args)
        calls["C"] += out is not None
        return out

    monkeypatch.setattr(cpu_bf16_step, name, counted)
    return calls


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    path = write_tiny_model(str(tmp_path_factory.mktemp("moe") / "qwen3_moe"),
                            dataclasses.replace(SIZES["tiny"], arch="qwen3_moe"), seed=0)
    engine = create_rollout_engine("native", path, dtype="bf16", num_threads=2, seed=5)
    assert engine.model.matmul == "bf16_tiles" and engine.model.layer_kernel is not None
    return engine


@pytest.mark.parametrize("rows", [1, 5, 33, 64, 256])  # an expert with no rows; tails of 16; MAX_ROWS
def test_routed_experts_in_one_call_are_the_dispatchs_bits(moe_engine, rows):
    decoder, g = moe_engine.model, torch.Generator().manual_seed(rows)
    for li in range(decoder.shape.num_layers):
        h = (torch.randn(rows, decoder.shape.hidden_size, generator=g) * 2).bfloat16()
        decoder.route_log = []
        got = cpu_bf16_step.routed_experts(decoder, li, h, decoder.layer_kernel)
        routes, decoder.route_log = decoder.route_log, None
        assert got is not None and len(routes) == 1 and routes[0].shape == (rows, decoder.shape.experts_per_token)
        assert torch.equal(got, decoder._mlp(li, h))  # router, then each expert's rows through F.linear-like calls
    more = torch.zeros(cpu_bf16_linear.MAX_ROWS + 1, decoder.shape.hidden_size, dtype=torch.bfloat16)
    assert cpu_bf16_step.routed_experts(decoder, 0, more, decoder.layer_kernel) is None  # the caller's MLP runs


def test_routed_experts_refuse_an_expert_id_out_of_range(moe_engine, monkeypatch):
    decoder = moe_engine.model
    h = torch.randn(4, decoder.shape.hidden_size).bfloat16()
    bad = torch.full((4, decoder.shape.experts_per_token), decoder.shape.num_experts)
    monkeypatch.setattr(cpu_bf16_step._RoutedState, "route",
                        lambda *args: (torch.ones(4, 2, dtype=torch.bfloat16), bad))
    with pytest.raises(IndexError, match=f"outside its {decoder.shape.num_experts}"):
        cpu_bf16_step.routed_experts(decoder, 0, h, decoder.layer_kernel)


def _torch_router(monkeypatch, decoder) -> None:
    """The routed layers route with torch's router (called back from the one-call step) from now on."""
    monkeypatch.setattr(cpu_bf16_step.cpu_moe_router, "load", lambda: None)
    monkeypatch.delitem(cpu_bf16_step._states, decoder, raising=False)


def test_routing_in_c_gives_the_torch_routers_tokens_and_routes(tmp_path, monkeypatch):
    """The one-call step's routing in C (the router's bf16 tile product, cpu_moe_router's softmax and top-k) against the
    same step calling torch's router back: the same tokens, log-probs and recorded routes."""
    router = cpu_bf16_step.cpu_moe_router.load()
    if router is None or not router.agrees(4, 2, True, torch.bfloat16):  # the tiny qwen3_moe's router
        pytest.skip("the C MoE router does not run here (no C++ compiler, torch not on its AVX-512 kernels, or "
                    "torch's results differ for this router's shape: then the step calls torch's router back)")
    path = write_tiny_model(str(tmp_path / "qwen3_moe"), dataclasses.replace(SIZES["tiny"], arch="qwen3_moe"), seed=2)
    engine = create_rollout_engine("native", path, dtype="bf16", num_threads=2, record_routes=True)
    prompts = make_prompts(engine.tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=7)
    calls = _count_calls(monkeypatch, "step")
    in_c = engine.generate(prompts, params)
    state = cpu_bf16_step._states[engine.model]
    assert calls["C"] > 0 and state.router is not None and all(struct.route for struct in state.layers.values())
    _torch_router(monkeypatch, engine.model)
    called_back = engine.generate(prompts, params)
    assert cpu_bf16_step._states[engine.model].router is None
    for key in ("responses", "rollout_log_probs", "routed_experts"):
        assert torch.equal(in_c.batch[key], called_back.batch[key]), key


def test_the_bf16_moe_decode_step_runs_its_experts_in_one_call(moe_engine, monkeypatch):
    """The layer-by-layer step (the whole step as one call is off here) with the experts as one call, against the
    op-by-op step."""
    monkeypatch.setattr(cpu_bf16_step, "step", lambda *args: None)
    calls = _count_calls(monkeypatch, "routed_experts")
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=7)
    prompts = make_prompts(moe_engine.tokenizer)
    one_call = moe_engine.generate(prompts, params)
    assert calls["C"] > 0
    moe_engine.model.layer_kernel, kernel = None, moe_engine.model.layer_kernel  # the op-by-op step
    try:
        ops = moe_engine.generate(prompts, params)
    finally:
        moe_engine.model.layer_kernel = kernel
    assert torch.equal(one_call.batch["responses"], ops.batch["responses"])
    assert torch.equal(one_call.batch["rollout_log_probs"], ops.batch["rollout_log_probs"])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe", "llama", "mistral", "gemma2", "gemma3_text", "phi3"])
def test_a_bf16_decode_step_as_one_call_is_the_layer_by_layer_steps_bits(tmp_path, arch, monkeypatch):
    """Sliding windows (mistral, gemma), soft-caps and sandwich norms (gemma2), q/k norms (qwen3, gemma3_text),
    biases (qwen2), routing in C (qwen3_moe), shared-prompt and per-row caches (n = 4 and n = 1),
    greedy and sampled."""
    path = write_tiny_model(str(tmp_path / arch), dataclasses.replace(SIZES["tiny"], arch=arch), seed=0)
    engine = create_rollout_engine("native", path, dtype="bf16", num_threads=2, seed=3)
    monkeypatch.setattr(cpu_bf16_step, "loop", lambda *args, **kwargs: None)  # the steps from Python (the C loop:
    calls = _count_calls(monkeypatch, "step")  # test_the_bf16_decode_loop_in_c_is_the_python_loops_bits)
    counted = cpu_bf16_step.step
    prompts = make_prompts(engine.tokenizer)
    for params in (SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=7),
                   SamplingParams(greedy=True, max_new_tokens=12),
                   # rows stop early and are dropped: the step's row count changes within the call
                   SamplingParams(temperature=1.0, max_new_tokens=16, n=4, seed=5, stop_token_ids=list(range(40, 90)))):
        monkeypatch.setattr(cpu_bf16_step, "step", counted)
        one_call = engine.generate(prompts, params)
        monkeypatch.setattr(cpu_bf16_step, "step", lambda *args: None)
        layers = engine.generate(prompts, params)
        assert torch.equal(one_call.batch["responses"], layers.batch["responses"])
        assert torch.equal(one_call.batch["rollout_log_probs"], layers.batch["rollout_log_probs"])
    assert calls["C"] > 0


def test_steps_of_more_rows_than_one_call_takes_run_layer_by_layer_with_the_same_bits(moe_engine, monkeypatch):
    """With MAX_ROWS at 3, a call's steps start layer by layer and turn to one call once rows have stopped: the
    outputs are those of a call that never takes the one-call step."""
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=4, seed=5, stop_token_ids=list(range(40, 90)))
    prompts = make_prompts(moe_engine.tokenizer)
    monkeypatch.setattr(cpu_bf16_step, "MAX_ROWS", 3)
    calls = _count_calls(monkeypatch, "step")
    mixed = moe_engine.generate(prompts, params)
    lengths = mixed.batch["response_mask"].sum(-1)
    assert calls["C"] > 0 and lengths.min() < lengths.max() and mixed.batch["responses"].shape[0] > 3
    monkeypatch.setattr(cpu_bf16_step, "step", lambda *args: None)
    layers = moe_engine.generate(prompts, params)
    assert torch.equal(mixed.batch["responses"], layers.batch["responses"])
    assert torch.equal(mixed.batch["rollout_log_probs"], layers.batch["rollout_log_probs"])


def test_the_one_call_steps_record_the_routes_and_raise_their_routers_errors(moe_engine, tmp_path, monkeypatch):
    path = write_tiny_model(str(tmp_path / "qwen3_moe"), dataclasses.replace(SIZES["tiny"], arch="qwen3_moe"), seed=1)
    recording = create_rollout_engine("native", path, dtype="bf16", num_threads=2, record_routes=True)
    prompts, params = make_prompts(recording.tokenizer), SamplingParams(greedy=True, max_new_tokens=6)
    calls = _count_calls(monkeypatch, "step")
    counted = cpu_bf16_step.step
    one_call = recording.generate(prompts, params).batch["routed_experts"]
    monkeypatch.setattr(cpu_bf16_step, "step", lambda *args: None)
    assert calls["C"] > 0 and torch.equal(one_call, recording.generate(prompts, params).batch["routed_experts"])

    def broken(*args):
        raise RuntimeError("a router that fails")

    monkeypatch.setattr(cpu_bf16_step, "step", counted)
    _torch_router(monkeypatch, moe_engine.model)  # the router called back from C: its errors come back
    monkeypatch.setattr(cpu_bf16_step, "route", broken)
    with pytest.raises(RuntimeError, match="a router that fails"):
        moe_engine.generate(prompts, params)
    monkeypatch.setattr(cpu_bf16_step, "route", lambda h, *args: (
        torch.ones(h.shape[0], 2, dtype=torch.bfloat16), torch.full((h.shape[0], 2), 99)))
    with pytest.raises(IndexError, match="outside its"):
        moe_engine.generate(prompts, params)
    monkeypatch.undo()
    assert moe_engine.generate(prompts, params).batch["responses"].shape[1] == 6  # the engine still works


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe", "llama", "mistral", "gemma2", "gemma3_text", "phi3"])
def test_the_bf16_decode_loop_in_c_is_the_python_loops_bits(tmp_path, arch, monkeypatch):
    """The bf16 decode loop in C (cpu_bf16_step.loop: choose, record, stop and the one-call step, step after step)
    against the Python loop around the same one-call steps: sampled, greedy, top-k and top-p, rows dropped as they
    stop, shared-prompt and per-row caches. Gemma 2's soft-capped logits keep the Python loop."""
    path = write_tiny_model(str(tmp_path / arch), dataclasses.replace(SIZES["tiny"], arch=arch), seed=0)
    engine = create_rollout_engine("native", path, dtype="bf16", num_threads=2, seed=3)
    real = cpu_bf16_step.loop
    made = []

    def counted(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    prompts = make_prompts(engine.tokenizer)
    for params in (SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=7),
                   SamplingParams(greedy=True, max_new_tokens=12),
                   SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=10, n=2, seed=3),
                   SamplingParams(temperature=1.0, max_new_tokens=16, n=4, seed=5, stop_token_ids=list(range(40, 90)))):
        monkeypatch.setattr(cpu_bf16_step, "loop", counted)
        in_c = engine.generate(prompts, params)
        monkeypatch.setattr(cpu_bf16_step, "loop", lambda *args, **kwargs: None)
        python = engine.generate(prompts, params)
        assert torch.equal(in_c.batch["responses"], python.batch["responses"])
        assert torch.equal(in_c.batch["rollout_log_probs"], python.batch["rollout_log_probs"])
    assert made and all((loop is None) == (arch == "gemma2") for loop in made)


def test_after_a_weight_update_the_c_routing_and_loop_match_a_fresh_engine(tmp_path):
    """update_weights re-packs the experts and the router in place: the next call (the router's product and routing
    in C, the loop in C) gives the tokens and log-probs of an engine loaded from the updated weights."""
    path = write_tiny_model(str(tmp_path / "before"), dataclasses.replace(SIZES["tiny"], arch="qwen3_moe"), seed=0)
    engine = create_rollout_engine("native", path, dtype="bf16", num_threads=2, seed=3)
    prompts, params = make_prompts(engine.tokenizer), SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=7)
    engine.generate(prompts, params)
    g = torch.Generator().manual_seed(1)
    (weights_file,) = glob.glob(f"{path}/*.safetensors")
    updated = {name: t + 0.05 * torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t
               for name, t in load_file(weights_file).items()}
    engine.update_weights(updated.items())
    after = engine.generate(prompts, params)
    assert all(struct.route for struct in cpu_bf16_step._states[engine.model].layers.values())
    other = shutil.copytree(path, str(tmp_path / "after"))
    save_file(updated, glob.glob(f"{other}/*.safetensors")[0], metadata={"format": "pt"})
    fresh = create_rollout_engine("native", other, dtype="bf16", num_threads=2, seed=3).generate(prompts, params)
    assert torch.equal(after.batch["responses"], fresh.batch["responses"])
    assert torch.equal(after.batch["rollout_log_probs"], fresh.batch["rollout_log_probs"])
