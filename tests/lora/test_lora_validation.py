"""Bad adapters and bad LoRA arguments are refused with ValueError before anything changes."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvtide import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def case(lora_case_factory):
    return lora_case_factory("LlamaForCausalLM")


@pytest.fixture(scope="module")
def llm(case):
    llm = LLM(case.base_dir, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory="8MiB",
              enable_lora=True, max_loras=2, max_lora_rank=8)
    yield llm
    llm.shutdown()


def edited_copy(src: str, dst: str, config_edit=None, weights_edit=None) -> str:
    shutil.copytree(src, dst)
    if config_edit is not None:
        path = os.path.join(dst, "adapter_config.json")
        with open(path) as f:
            config = json.load(f)
        config_edit(config)
        with open(path, "w") as f:
            json.dump(config, f)
    if weights_edit is not None:
        path = os.path.join(dst, "adapter_model.safetensors")
        save_file(weights_edit(load_file(path)), path)
    return dst


def assert_refused(llm: LLM, request: LoRARequest, match: str) -> None:
    state_before = llm.engine.core.executor.lora_stats()
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hello there", "Hi"], GREEDY, lora_request=request)
    assert not llm.engine.has_unfinished_requests()
    after = llm.engine.core.executor.lora_stats()
    assert (after["host"], after["resident"]) == (state_before["host"], state_before["resident"])


def test_bad_lora_request_fields():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("a", 1, "")


def test_rank_above_max_lora_rank(llm, case):
    assert_refused(llm, LoRARequest("big", 5, case.adapter_dirs["all-r16-rslora"]), "rank 16, above max_lora_rank=8")


def test_target_modules_the_model_lacks(llm, case, tmp_path):
    path = edited_copy(case.adapter_dirs["attn-r8"], str(tmp_path / "fake"),
                       config_edit=lambda c: c.update(target_modules=["q_proj", "w_fake"]))
    assert_refused(llm, LoRARequest("fake", 6, path), "targets modules the model lacks: w_fake")


def test_tensor_for_a_module_the_model_lacks(llm, case, tmp_path):
    def rename(tensors):
        key = next(k for k in tensors if ".layers.0." in k)
        tensors[key.replace(".layers.0.", ".layers.99.")] = tensors.pop(key)
        return tensors
    path = edited_copy(case.adapter_dirs["attn-r8"], str(tmp_path / "extra"), weights_edit=rename)
    assert_refused(llm, LoRARequest("extra", 7, path), "names a module the model lacks")


def test_wrong_shapes(llm, case, tmp_path):
    def cut(tensors):
        key = next(k for k in tensors if "lora_B" in k)
        tensors[key] = tensors[key][:, :4].contiguous()
        return tensors
    path = edited_copy(case.adapter_dirs["attn-r8"], str(tmp_path / "cut"), weights_edit=cut)
    assert_refused(llm, LoRARequest("cut", 8, path), "the model needs")


def test_malformed_and_missing_files(llm, case, tmp_path):
    broken = edited_copy(case.adapter_dirs["attn-r8"], str(tmp_path / "broken"))
    with open(os.path.join(broken, "adapter_config.json"), "w") as f:
        f.write("{not json")
    assert_refused(llm, LoRARequest("broken", 9, broken), "not valid JSON")
    no_weights = edited_copy(case.adapter_dirs["attn-r8"], str(tmp_path / "no-weights"))
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    assert_refused(llm, LoRARequest("no-weights", 10, no_weights), "has no adapter_model.safetensors")
    garbage = edited_copy(case.adapter_dirs["attn-r8"], str(tmp_path / "garbage"))
    with open(os.path.join(garbage, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x00" * 64)
    assert_refused(llm, LoRARequest("garbage", 11, garbage), "cannot read adapter_model.safetensors")
    assert_refused(llm, LoRARequest("missing", 12, str(tmp_path / "nowhere")), "does not exist")


def test_one_id_for_two_adapters(llm, case):
    llm.generate(["Hi"], GREEDY, lora_request=LoRARequest("attn", 1, case.adapter_dirs["attn-r8"]))
    assert_refused(llm, LoRARequest("other", 1, case.adapter_dirs["mlp-r4"]), "already names adapter 'attn'")


def test_lora_request_list_must_match_prompts(llm, case):
    request = LoRARequest("attn", 1, case.adapter_dirs["attn-r8"])
    with pytest.raises(ValueError, match="got 1 for 2 prompts"):
        llm.generate(["a", "b"], GREEDY, lora_request=[request])
    with pytest.raises(ValueError, match="LoRARequest"):
        llm.generate(["a"], GREEDY, lora_request=["attn"])
    assert not llm.engine.has_unfinished_requests()


def test_adapters_need_enable_lora(case):
    llm = LLM(case.base_dir, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate(["Hi"], GREEDY, lora_request=LoRARequest("attn", 1, case.adapter_dirs["attn-r8"]))
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_max_cpu_loras_below_max_loras_is_refused(case):
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(case.base_dir, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_adapter_gone_before_its_reload_fails_only_its_requests(case, tmp_path):
    """An adapter evicted from host memory whose files vanish before a step needs it again: its
    requests end (finish_reason "abort"), the others and the engine go on."""
    llm = LLM(case.base_dir, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory="8MiB",
              enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    try:
        doomed = LoRARequest("doomed", 1, shutil.copytree(case.adapter_dirs["attn-r8"], str(tmp_path / "doomed")))
        other = LoRARequest("mlp", 2, case.adapter_dirs["mlp-r4"])
        llm.engine.add_lora(doomed)
        llm.engine.add_lora(other)  # one host slot: the first is evicted
        llm.engine.add_request("gone", "Hello", GREEDY, lora_request=doomed)
        llm.engine.add_request("fine", "Hello", GREEDY, lora_request=other)
        shutil.rmtree(doomed.lora_path)
        outputs = {o.request_id: o for o in llm._run(["gone", "fine"], use_tqdm=False)}
        assert outputs["gone"].outputs[0].finish_reason == "abort"
        assert outputs["fine"].outputs[0].finish_reason == "length" and len(outputs["fine"].outputs[0].token_ids) == 4
        assert llm.generate(["Hi"], GREEDY, lora_request=other)[0].outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()


def test_unloading_an_adapter_in_use_lets_its_requests_finish(llm, case):
    lora = LoRARequest("in-use", 20, case.adapter_dirs["attn-r8"])
    alone = llm.generate(["Hello there"], GREEDY, lora_request=lora)[0].outputs[0].token_ids
    llm.engine.add_lora(lora)
    llm.engine.add_request("in-flight", "Hello there", GREEDY, lora_request=lora)
    llm.engine.remove_lora(lora.lora_int_id)  # deferred: a request still runs with it
    assert 20 in llm.engine.core.executor.lora_stats()["host"]
    out = llm._run(["in-flight"], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == alone and out.finish_reason == "length"
    stats = llm.engine.core.executor.lora_stats()
    assert 20 not in stats["host"] and 20 not in stats["resident"]
