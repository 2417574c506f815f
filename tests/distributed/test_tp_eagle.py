"""EAGLE and EAGLE-3 heads on a TP=2 replica (real worker processes, gloo, one thread per rank): each
rank loads its shard of the head (heads, MLP and its own tables split), and the replica proposes
what TP=1 proposes: the same drafts, the head's logits within float tolerance, the same acceptance
counters, and the greedy output of plain decoding (tokens exact, logprobs within 1e-4).

Random heads almost never propose an accepted token, which would leave the accepted-run paths
untested, so the heads here are built to propose well on a target whose attention outputs are all
zero: its next token is then a function f of the current one (computed with transformers). The
EAGLE-1 head's residual carries a code of the token it reads and its own LM head reads f out of
the code; the EAGLE-3 head's residual starts from the target's state at that position (aux layer
1's input), from which a least-squares readout over a 160-token draft vocabulary guesses f(f(t)).
Their attention and MLP weights are random, so both heads' drafts depend on every shard.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtide import LLM, SamplingParams
from kvtide.engine_args import EngineArgs
from kvtide.models.demo import make_random_checkpoint

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 128, 8
DRAFT_VOCAB = 160
MAX_MODEL_LEN = 256
LOGPROB_TOL = 1e-4
PROMPTS = ["Hello", "abc abc abc abc", "The quick brown fox", "1 2 3 1 2 3 1 2 3", "draft tokens", "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, str]:
    """The target (attention outputs zeroed) and its two heads: {"target", "eagle", "eagle3"} -> dir."""
    from transformers import AutoModelForCausalLM

    target = make_random_checkpoint(str(tmp_path_factory.mktemp("target")), seed=0, hidden_size=HIDDEN,
                                    intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_MODEL_LEN)
    file = os.path.join(target, "model.safetensors")
    tensors = {name: t * 0.0 if name.endswith("o_proj.weight") else t for name, t in load_file(file).items()}
    save_file(tensors, file, metadata={"format": "pt"})
    vocab = json.load(open(os.path.join(target, "config.json")))["vocab_size"]
    with torch.no_grad():  # every token alone: its greedy successor, and aux layer 1's input
        out = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()(
            input_ids=torch.arange(vocab)[:, None], output_hidden_states=True)
    successor = out.logits[:, -1].argmax(-1)
    layer1_input = out.hidden_states[1][:, -1]
    g = torch.Generator().manual_seed(5)

    def rand(*shape, scale=0.02):
        return torch.randn(*shape, generator=g) * scale

    def decoder_layer(prefix: str, qkv_in: int) -> dict[str, torch.Tensor]:
        head_dim = HIDDEN // HEADS
        return {f"{prefix}self_attn.q_proj.weight": rand(HEADS * head_dim, qkv_in),
                f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * head_dim, qkv_in),
                f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * head_dim, qkv_in),
                f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
                f"{prefix}mlp.gate_proj.weight": rand(INTER, HIDDEN), f"{prefix}mlp.up_proj.weight": rand(INTER, HIDDEN),
                f"{prefix}mlp.down_proj.weight": rand(HIDDEN, INTER),
                f"{prefix}post_attention_layernorm.weight": 1 + rand(HIDDEN, scale=0.1)}

    def readout(features: torch.Tensor, labels: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """(len(rows), hidden) LM head whose argmax over RMS-normalized `features` fits `labels`."""
        x = features / features.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
        y = torch.zeros(len(features), len(rows))
        index = {token: i for i, token in enumerate(rows)}
        for row, label in enumerate(labels.tolist()):
            if label in index:
                y[row, index[label]] = 1.0
        return (torch.linalg.pinv(x) @ y).T.contiguous()

    def write(name: str, architecture: str, tensors: dict[str, torch.Tensor], **config) -> str:
        path = str(tmp_path_factory.mktemp(name))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dict(architectures=[architecture], model_type="llama", hidden_size=HIDDEN,
                           intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=HEADS,
                           num_key_value_heads=KV_HEADS, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=10000.0,
                           max_position_embeddings=MAX_MODEL_LEN, hidden_act="silu", **config), f)
        save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(path, "model.safetensors"))
        return path

    codes = torch.randn(vocab, HIDDEN, generator=g)
    eagle = write("eagle", "LlamaForCausalLM", {  # fc keeps the token's code; its own table and LM head
        "fc.weight": torch.cat((torch.eye(HIDDEN), rand(HIDDEN, HIDDEN)), dim=1), "fc.bias": rand(HIDDEN),
        **decoder_layer("layers.0.", HIDDEN), "embed_tokens.weight": codes,
        "lm_head.weight": readout(codes, successor, list(range(vocab)))})
    twice = successor[successor]
    image = sorted(set(twice.tolist()))
    others = [t for t in torch.randperm(vocab, generator=g).tolist() if t not in image]
    draft_ids = torch.tensor(sorted(image + others[:DRAFT_VOCAB - len(image)]))
    eagle3 = write("eagle3", "LlamaForCausalLMEagle3", {  # the target's table: shared, not loaded twice
        "fc.weight": torch.cat((torch.eye(HIDDEN), rand(HIDDEN, HIDDEN), rand(HIDDEN, HIDDEN)), dim=1),
        **decoder_layer("midlayer.", 2 * HIDDEN), "midlayer.input_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + rand(HIDDEN, scale=0.1), "norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": readout(layer1_input, twice, draft_ids.tolist()),
        "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        "d2t": draft_ids - torch.arange(DRAFT_VOCAB)},
        draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=[1, LAYERS // 2, LAYERS - 2])
    return {"target": target, "eagle": eagle, "eagle3": eagle3}


def spec_config(heads: dict[str, str], method: str) -> dict:
    return {"method": method, "model": heads[method], "num_speculative_tokens": 3, "adaptive": False,
            "disable_by_batch_size": 64}


def run(target: str, spec: dict | None, **parallel) -> dict:
    """Greedy outputs, with rank 0's drafts and head logits per proposal and the head's shapes there."""
    llm = LLM(target, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="4MiB",
              speculative_config=spec, **parallel)
    result: dict = {"drafts": [], "logits": []}
    try:
        worker = llm.engine.core.executor.runner.spec
        if worker is not None:
            propose, head = worker.propose, worker.proposer.head
            compute_logits = head.compute_logits

            def recording_propose(so, requests):
                drafts = propose(so, requests)
                result["drafts"].append(sorted(drafts.items()))
                return drafts

            def recording_logits(features):
                logits = compute_logits(features)
                result["logits"].append(logits.clone())
                return logits

            worker.propose, head.compute_logits = recording_propose, recording_logits
            result["shapes"] = {name: tuple(p.shape) for name, p in head.named_parameters()}
        outputs = llm.generate(PROMPTS, GREEDY)
        result["tokens"] = [o.outputs[0].token_ids for o in outputs]
        result["logprobs"] = [[entry[t].logprob for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                                     strict=True)] for o in outputs]
        result["stats"] = llm.engine.core.get_stats().spec_decoding
        result["used_blocks"] = llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks
    finally:
        llm.shutdown()
    return result


@pytest.fixture(scope="module")
def plain(heads) -> dict:
    return run(heads["target"], None)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_tp2_proposes_what_tp1_proposes(heads, plain, method):
    single = run(heads["target"], spec_config(heads, method))
    got = run(heads["target"], spec_config(heads, method), tensor_parallel_size=2, cpu_threads_per_rank=1)
    for i, (tokens, ref) in enumerate(zip(got["tokens"], plain["tokens"], strict=True)):
        assert tokens == ref, f"{method}: prompt {i}"
        assert got["logprobs"][i] == pytest.approx(plain["logprobs"][i], abs=LOGPROB_TOL), f"{method}: prompt {i}"
    assert single["tokens"] == plain["tokens"]
    assert got["drafts"] == single["drafts"], f"{method}: TP=2 proposed other drafts than TP=1"
    assert len(got["logits"]) == len(single["logits"])
    for a, b in zip(got["logits"], single["logits"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    stats = got["stats"]
    assert stats == single["stats"]
    assert stats["num_accepted_tokens"] > 0 and stats["num_rejections"] > 0, stats  # both paths ran
    assert got["used_blocks"] == 0
    # rank 0 holds its shard: half the query heads, KV heads and MLP rows; a vocabulary-parallel LM head
    attn = "layers.0.self_attn" if method == "eagle" else "midlayer.self_attn"
    prefix = attn.rsplit(".", 1)[0]
    whole, shard = single["shapes"], got["shapes"]
    assert shard[f"{attn}.qkv_proj.weight"][0] * 2 == whole[f"{attn}.qkv_proj.weight"][0]
    assert shard[f"{attn}.o_proj.weight"][1] * 2 == whole[f"{attn}.o_proj.weight"][1]
    assert shard[f"{prefix}.mlp.gate_up_proj.weight"][0] * 2 == whole[f"{prefix}.mlp.gate_up_proj.weight"][0]
    assert shard["lm_head.weight"][0] == -(-whole["lm_head.weight"][0] // 2)  # padded to a multiple of 2
    assert ("embed_tokens.weight" in shard) == (method == "eagle")  # EAGLE-3's table is the target's


def test_eagle_parallel_refusals(heads, tmp_path):
    def config_error(spec: dict, **parallel) -> str:
        with pytest.raises(ValueError) as info:
            EngineArgs(model=heads["target"], cpu_threads_per_rank=1, speculative_config=spec,
                       **parallel).create_engine_config(heads["target"])
        return str(info.value)

    message = config_error(spec_config(heads, "eagle3"), pipeline_parallel_size=2)
    assert "'eagle3' does not combine with pipeline parallelism" in message
    narrow = tmp_path / "two-heads"  # the head's 2 query heads cannot be split over 4 ranks
    narrow.mkdir()
    config = json.load(open(os.path.join(heads["eagle"], "config.json")))
    json.dump({**config, "num_attention_heads": 2, "num_key_value_heads": 2}, open(narrow / "config.json", "w"))
    os.symlink(os.path.join(heads["eagle"], "model.safetensors"), narrow / "model.safetensors")
    message = config_error({**spec_config(heads, "eagle"), "model": str(narrow)}, tensor_parallel_size=4)
    assert "the EAGLE head's attention heads (2)" in message
