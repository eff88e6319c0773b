"""Tensor and expert parallelism on real torch.distributed process groups (gloo, 2 processes on this machine):
TP=2 equals TP=1 token for token with logits within 1e-4 (fp32) for every family that splits its weights; each
rank holds about half the weights; a TP server answers through the openai client and dies cleanly with a rank."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import save_tiny
from resin import LLM, SamplingParams
from server_utils import ServerProcess, free_port
from tp_utils import PROMPTS, greedy_tp2_equals_tp1, run_tp

pytestmark = pytest.mark.distributed
if torch.cuda.is_available() and torch.cuda.device_count() < 2:
    pytest.skip(f"requires 2 GPUs (this machine has {torch.cuda.device_count()})", allow_module_level=True)

# (id, architecture, config overrides, expert parallel)
CASES = [
    ("llama-9-heads-3-kv", "LlamaForCausalLM",  # uneven split: 2 KV heads (6 query heads) + 1 (3)
     dict(num_attention_heads=9, num_key_value_heads=3, head_dim=8, hidden_size=72), False),
    ("llama-tied-odd-vocab", "LlamaForCausalLM", dict(tie_word_embeddings=True, vocab_size=213), False),
    ("qwen2", "Qwen2ForCausalLM", {}, False),
    ("qwen3-one-kv-head", "Qwen3ForCausalLM", dict(num_key_value_heads=1), False),  # KV head replicated
    ("qwen3-moe-tp", "Qwen3MoeForCausalLM", {}, False),
    ("qwen3-moe-ep", "Qwen3MoeForCausalLM", {}, True),
    ("mixtral-ep", "MixtralForCausalLM", {}, True),
    ("gemma2", "Gemma2ForCausalLM", {}, False),
    ("gemma3", "Gemma3ForCausalLM", {}, False),
    ("gpt-oss-tp", "GptOssForCausalLM", {}, False),  # sinks split with their heads, biased interleaved experts
    ("gpt-oss-ep", "GptOssForCausalLM", {}, True),
    ("qwen3-next-tp", "Qwen3NextForCausalLM", {}, False),  # key heads split in the linear-attention layers
    ("qwen3-next-ep", "Qwen3NextForCausalLM", {}, True),
    ("qwen2-moe-tp", "Qwen2MoeForCausalLM", {}, False),  # gated shared expert split like a dense MLP
    ("glm4-moe-ep", "Glm4MoeForCausalLM", {}, True),  # grouped sigmoid routing with a correction bias
    ("deepseek-v3-tp", "DeepseekV3ForCausalLM", {}, False),  # heads split, the latent cache whole on each rank
    ("deepseek-v2-ep", "DeepseekV2ForCausalLM", {}, True),
]
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tp2_equals_tp1(case, tmp_path):
    _, arch, overrides, ep = case
    save_tiny(tmp_path, arch, seed=hash(case[0]) % 1000, **overrides)
    ref, ref_rec, (ref_bytes,) = run_tp(tmp_path, 1)
    got, rec, rank_bytes = run_tp(tmp_path, 2, ep)
    assert len(rank_bytes) == 2
    for i, (a, b) in enumerate(zip(ref, got)):
        assert b.error is None, b.error
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        diff = (rec.of(b.request_id) - ref_rec.of(a.request_id)).abs().max().item()
        assert diff <= 1e-4, f"prompt {i}: logits differ by {diff}"
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):  # the vocabulary-parallel head, again
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) <= 1e-4 for t in pa)
    # every rank holds about half: only norms, routers and the rope table are whole on each
    assert max(rank_bytes) < 0.62 * ref_bytes, (rank_bytes, ref_bytes)
    assert sum(rank_bytes) > ref_bytes


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3NextForCausalLM"])  # Qwen3-Next: forks copy state
def test_sampling_with_n_and_seed_equals_tp1(arch, tmp_path):
    save_tiny(tmp_path, arch)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, n=3, seed=7, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=tp)
        outs[tp] = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
        llm.shutdown()
    assert outs[1] == outs[2]


def test_bad_sizes_name_the_problem(tmp_path):
    save_tiny(tmp_path, "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not fit 4 query heads"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="enable-expert-parallel"):
        LLM(str(tmp_path), dtype="float32", enable_expert_parallel=True)
    save_tiny(tmp_path / "next", "Qwen3NextForCausalLM", num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(ValueError, match="exceeds the 2 key heads of the linear-attention layers"):
        LLM(str(tmp_path / "next"), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=3)
    from resin.models.loader import check_tensor_parallel

    with pytest.raises(ValueError, match="does not run under tensor parallelism yet"):
        check_tensor_parallel("NewForCausalLM", type("NewForCausalLM", (), {}))  # a family must say it splits
    ok = LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB")  # a failed start left no group behind
    assert ok.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].error is None


def test_two_node_launch_with_torchrun(text_model, tmp_path):
    """Two torchrun launches, one per "node" (node ranks 0 and 1), joined by torch's static rendezvous on this
    machine: the same command on both; node 0's rank 0 prints what TP=1 prints."""
    folder, _ = text_model
    cmd = ["generate", "Hello world", "--model", str(folder), "--dtype", "float32", "--max-tokens", "12",
           "--kv-cache-memory", "16MiB", "--ignore-eos"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ref = subprocess.run([sys.executable, "-m", "resin.cli", "-q", *cmd], capture_output=True, text=True, env=env,
                         timeout=300)
    assert ref.returncode == 0, ref.stderr
    port = free_port()
    launches = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "resin.cli", "-q", *cmd, "--tensor-parallel-size", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for node in (0, 1)]
    results = [p.communicate(timeout=300) for p in launches]
    report = "\n".join(f"node {i}: exit {p.returncode}\n{err}"
                       for i, (p, (_, err)) in enumerate(zip(launches, results)))
    assert [p.returncode for p in launches] == [0, 0], report
    assert results[0][0] == ref.stdout, report
    assert results[1][0] == ""  # rank 1 only runs steps


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def _port_free(port: int) -> bool:
    """Nothing listens there any more (connections the server closed may linger in TIME_WAIT: SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_server_answers_and_a_killed_rank_ends_it(builtin_model_ready):
    srv = ServerProcess("--tensor-parallel-size", "2", "--kv-cache-memory", "128MiB").wait_ready(timeout=300)
    try:
        client = srv.client()
        # "Answer in one word": without it the first token is a near-tie ("The" over "L'" by 0.08 nats in fp32,
        # below bf16's logit step at that size), which any bf16 variant (TP=1 dense included) can tip either way
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            temperature=0, max_tokens=32).choices[0].message.content
        assert "Paris" in reply
        assert "tensor parallel over 2 ranks" in srv.logs()
        workers = [p for p in _children(srv.proc.pid) if "resource_tracker" not in _cmdline(p)
                   and "multiprocessing" in _cmdline(p)]
        assert len(workers) == 1, [_cmdline(p) for p in _children(srv.proc.pid)]
        killed = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        code = srv.proc.wait(timeout=20)
        assert time.monotonic() - killed < 10
        assert code != 0
        assert "rank 1 exited with code -9" in srv.logs()
        assert _port_free(srv.port)
        assert not Path(f"/proc/{workers[0]}").exists() or "zombie" in Path(f"/proc/{workers[0]}/status").read_text()
    finally:
        srv.stop(timeout=5)


@pytest.fixture(scope="module")
def builtin_model_ready():
    from resin.builtin import ensure_builtin_model

    return ensure_builtin_model(progress=False)


def test_collectives_are_ops_in_the_table():
    from resin.hal import select_backend

    table = select_backend("cpu").table
    for op in ("all_reduce", "all_gather"):  # shared memory first, gloo (native) behind it
        assert [p.name for p in table[op].chain] == ["shm", "native"]
    assert torch.equal(table["all_reduce"].chain[-1].fn(torch.ones(3)), torch.ones(3))  # one rank: identity


def test_step_broadcast_in_a_real_group(tmp_path):
    """The StepChannel's bytes over gloo: every dtype the steps send arrives equal, shapes included."""
    script = tmp_path / "channel.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "from resin.core.step_channel import Command, StepChannel\n"
        "rank = int(sys.argv[1])\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=rank, world_size=2)\n"
        "g = torch.Generator().manual_seed(int(sys.argv[2]))\n"
        "ts = [torch.randint(0, 99, (5,), generator=g), torch.randint(0, 9, (2, 3, 4), generator=g).int(),\n"
        "      torch.rand(3, 7, generator=g).bfloat16(), torch.rand(0, 2, generator=g), torch.tensor([True, False]),\n"
        "      torch.rand(3, generator=g).half(), torch.rand(2, 2, generator=g)]\n"
        "ch = StepChannel(dist.group.WORLD, rank)\n"
        "if rank == 0:\n"
        "    ch.send(Command.STEP, ts); ch.send(Command.STOP)\n"
        "else:\n"
        "    cmd, got = ch.recv(); stop, none = ch.recv()\n"
        "    assert cmd is Command.STEP and stop is Command.STOP and none == []\n"
        "    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ts, got)), got\n"
        "dist.barrier(); dist.destroy_process_group()\n"
        "import os, sys; sys.stdout.flush(); os._exit(0)\n")
    seed = str(int(torch.randint(0, 1 << 30, (1,))))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), seed], stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()


def test_a_raising_rank_ends_the_engine(text_model, tmp_path):
    """A rank whose step raises exits; rank 0's engine fails its requests and the process exits non-zero,
    in seconds (the failing rank is made to raise by a sitecustomize every process of the test loads)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import resin.core.model_runner as m\n"
        "from resin.hal import parallel\n"
        "forward = m.ModelRunner.forward\n"
        "def failing(self, inputs):\n"
        "    if parallel().rank == 1 and inputs.num_tokens == 1:\n"
        "        raise RuntimeError('injected fault in rank 1')\n"
        "    return forward(self, inputs)\n"
        "m.ModelRunner.forward = failing\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "resin.cli", "generate", "Hello", "--model", str(text_model[0]),
                        "--dtype", "float32", "--kv-cache-memory", "16MiB", "--tensor-parallel-size", "2",
                        "--max-tokens", "4"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode != 0
    assert "injected fault in rank 1" in p.stderr
    # rank 0 learns of the death from its watcher or, first, from the shared-memory wait on the dead peer
    assert "rank 1 exited with code 1" in p.stderr or "rank 1 (pid" in p.stderr and "is gone" in p.stderr
    assert time.monotonic() - start < 60


def test_gloo_collectives_equal_tp1(tmp_path):
    """The native collectives (gloo), as between machines: the shared-memory provider forced off."""
    save_tiny(tmp_path, "Qwen3MoeForCausalLM", seed=11)
    greedy_tp2_equals_tp1(tmp_path, ops="all_reduce=native,all_gather=native")


def test_ranks_wait_out_an_idle_engine(tmp_path, monkeypatch):
    """The other ranks wait for the next step without a time limit (a server may idle for hours), although a
    collective inside a step has one."""
    monkeypatch.setenv("RESIN_DIST_TIMEOUT", "1")
    save_tiny(tmp_path, "LlamaForCausalLM")
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2)
    try:
        first = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        time.sleep(3)
        again = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        assert again.error is None and again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.shutdown()
