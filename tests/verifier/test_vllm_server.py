"""vLLM on CPU against the toy targets: same greedy tokens as HF, DeepseekV3 loads, clear failures."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import requests

from hpc.errors import UserError
from hpc.verifier.vllm_env import MARKER, ensure_vllm_venv
from hpc.verifier.vllm_server import DEFAULT_ENV, start_vllm_server
from hpc_dev.toy_train import greedy_ids

PROMPTS = [
    "def ",
    "class Foo:\n    def __init__(self",
    "import os\nimport sys\n\n",
    "<|im_user|>user<|im_middle|>def parse(text):<|im_end|><|im_assistant|>assistant<|im_middle|>",
]
NEW_TOKENS = 24


def test_missing_torch_wheel_fails_early_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_WHEEL_DIR", str(tmp_path / "wheels"))
    with pytest.raises(UserError) as err:
        ensure_vllm_venv(tmp_path / "venv")
    assert "torch 2.13.0+cpu" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "venv").exists()


def test_ready_venv_is_reused_without_pip(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / MARKER).write_text("")
    monkeypatch.setenv("DSPARK_WHEEL_DIR", str(tmp_path / "none"))  # a rebuild would fail loudly
    assert ensure_vllm_venv(venv) == venv / "bin" / "python"


@pytest.mark.slow
def test_vllm_greedy_matches_hf(vllm_server, toy_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_target)
    model = AutoModelForCausalLM.from_pretrained(toy_target).eval()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    resp = requests.post(
        f"{vllm_server.url}/v1/completions", headers=vllm_server.headers,
        json={
            "model": str(toy_target), "prompt": prompts, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
        },
        timeout=120,
    )
    resp.raise_for_status()
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    for prompt, ids, choice in zip(PROMPTS, prompts, choices):
        expected = greedy_ids(model, ids, NEW_TOKENS)
        assert choice["token_ids"] == expected, f"prompt {prompt!r}: vLLM {choice['text']!r}"


@pytest.mark.slow
def test_server_refuses_requests_without_its_key(vllm_server, toy_target):
    body = {"model": str(toy_target), "prompt": [1, 2, 3], "max_tokens": 1}
    assert requests.post(f"{vllm_server.url}/v1/completions", json=body, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer guess"}
    assert requests.post(f"{vllm_server.url}/v1/completions", json=body, headers=wrong, timeout=30).status_code == 401
    ok = requests.post(f"{vllm_server.url}/v1/completions", json=body, headers=vllm_server.headers, timeout=60)
    assert ok.status_code == 200
    # vLLM's own key covers only /v1, /v2, /inference, /cohere; ours covers the rest: /invocations
    # serves completions, /metrics is what evaluations read, /tokenize runs the tokenizer.
    for method, path, payload in (("post", "/invocations", body), ("get", "/metrics", None),
                                  ("post", "/tokenize", {"model": str(toy_target), "prompt": "hi"})):
        call = getattr(requests, method)
        assert call(f"{vllm_server.url}{path}", json=payload, timeout=30).status_code == 401, path
        assert call(f"{vllm_server.url}{path}", json=payload, headers=vllm_server.headers, timeout=60).status_code \
            == 200, path
    # /pooling serves embedding models; for this one it answers an error, but only behind the key.
    pooling = {"model": str(toy_target), "input": "hi"}
    assert requests.post(f"{vllm_server.url}/pooling", json=pooling, timeout=30).status_code == 401
    assert requests.post(f"{vllm_server.url}/pooling", json=pooling, headers=vllm_server.headers,
                         timeout=60).status_code != 401
    assert requests.get(f"{vllm_server.url}/health", timeout=30).status_code == 200  # readiness stays open
    # The key reaches vLLM through its environment: argv is readable by every user in `ps`.
    assert vllm_server.api_key not in " ".join(map(str, vllm_server.proc.args))
    # Its engine's ZMQ sockets are in its own dir, which stop() removes, not loose in /tmp.
    assert vllm_server.rpc_dir is not None and any(p.is_socket() for p in vllm_server.rpc_dir.iterdir())
    # So is its executor's rendezvous file, which vLLM never removes.
    assert vllm_server.tmp_dir is not None and any(p.name.startswith("vllm_dist_") for p in vllm_server.tmp_dir.iterdir())


def test_a_process_squatting_on_the_port_is_not_taken_for_our_server(tmp_path):
    # vLLM binds its port only after loading the model; whoever binds it first must not be trusted.
    import http.server
    import sys
    import threading

    from hpc.verifier.vllm_server import VLLMServer

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    squatter = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    server = VLLMServer(proc=ours, host="127.0.0.1", port=squatter.server_address[1], model="m",
                        log_path=tmp_path / "log", api_key="k")
    try:
        with pytest.raises(UserError, match="another process answers on 127.0.0.1"):
            server.wait_healthy(timeout=30)
        assert ours.poll() is not None, "our half-started server is stopped"
    finally:
        squatter.shutdown()
        ours.kill()


def test_each_server_keeps_its_sockets_and_temp_files_in_its_own_dirs_and_removes_them(tmp_path):
    # vLLM leaves a ZMQ socket file per engine and a rendezvous file per start in the temp dir; a CI
    # day left 3,500 sockets and 300 rendezvous files in /tmp.
    import sys

    (tmp_path / "fakevllm.py").write_text(
        "import os, socket, time\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "import tempfile; tempfile.mkstemp(prefix='vllm_dist_')\n"  # its executor's rendezvous file
        "s.bind(os.path.join(os.environ['VLLM_RPC_BASE_PATH'], 'engine'))\n"
        "time.sleep(60)\n")
    server = start_vllm_server(sys.executable, "m", entrypoint="fakevllm", env={"PYTHONPATH": str(tmp_path)},
                               log_path=tmp_path / "log", wait=False)
    try:
        assert server.rpc_dir is not None and server.rpc_dir.parent == Path(tempfile.gettempdir())
        deadline = time.monotonic() + 30
        while not (server.rpc_dir / "engine").is_socket():
            assert time.monotonic() < deadline and server.proc.poll() is None, (tmp_path / "log").read_text()
            time.sleep(0.1)
        assert server.tmp_dir is not None and [p.name[:10] for p in server.tmp_dir.iterdir()] == ["vllm_dist_"]
    finally:
        server.stop()
    assert not server.rpc_dir.exists() and not server.tmp_dir.exists()
    # A caller's own VLLM_RPC_BASE_PATH is left to it.
    own = tmp_path / "rpc"
    own.mkdir()
    kept = start_vllm_server(sys.executable, "m", entrypoint="fakevllm",
                             env={"PYTHONPATH": str(tmp_path), "VLLM_RPC_BASE_PATH": str(own)},
                             log_path=tmp_path / "log2", wait=False)
    kept.stop()
    assert kept.rpc_dir is None and own.is_dir()


@pytest.mark.slow
def test_vllm_runs_the_deepseek_toy(vllm_python, toy_deepseek):
    # Offline engine in-process: ~10x quicker to start than a second server, same model loader.
    # CPU_MLA, the reference MLA: on a CPU with AMX tiles vLLM otherwise picks AMX_MLA, whose packed
    # weights must be bf16/fp16, and the float32 toy fails to load.
    script = textwrap.dedent(f"""
        import json
        from vllm import LLM, SamplingParams
        llm = LLM(model={str(toy_deepseek)!r}, dtype="float32", enforce_eager=True,
                  gpu_memory_utilization=0.5, max_model_len=512, attention_backend="CPU_MLA")
        out = llm.generate([{{"prompt_token_ids": [10, 20, 30, 40]}}],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        print("RESULT", json.dumps(list(out[0].outputs[0].token_ids)))
    """)
    env = {**os.environ, **DEFAULT_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [str(vllm_python), "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    ids = json.loads(result.split(" ", 1)[1])
    assert len(ids) == 8 and all(isinstance(i, int) for i in ids), tail


@pytest.mark.slow
def test_server_that_never_gets_healthy_raises_with_log(vllm_python, tmp_path):
    log = tmp_path / "server.log"
    server = start_vllm_server(vllm_python, tmp_path / "no-such-model", log_path=log, wait=False,
                               env={"HF_HUB_OFFLINE": "1"})
    with pytest.raises(UserError) as err:
        server.wait_healthy(timeout=3)
    message = str(err.value)
    assert "not healthy after 3s" in message and str(log) in message
    assert "vllm.entrypoints.openai.api_server" in message  # the log's lines are shown
    assert server.proc.poll() is not None, "the server must be stopped"


@pytest.mark.slow
def test_server_that_exits_raises_with_its_error(vllm_python, tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(UserError) as err:
        start_vllm_server(vllm_python, tmp_path / "no-such-model", log_path=log, timeout=300,
                          env={"HF_HUB_OFFLINE": "1"})
    message = str(err.value)
    assert "exited with code" in message
    assert "no-such-model" in message, message


def test_vllm_does_not_inherit_our_ranks_variables(tmp_path, monkeypatch):
    """A streamer rank spawns vLLM: our LOCAL_RANK would pick vLLM's GPU, our *_SOCKET_IFNAME and
    TORCH_NCCL_* would steer its communicators. A site's NCCL setting and verifier.env pass."""
    import sys

    from hpc.own_env import RECORD, set_own

    monkeypatch.delenv(RECORD, raising=False)
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")  # the site's, set before we ran
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    for name, value in (("LOCAL_RANK", "3"), ("NCCL_SOCKET_IFNAME", "ib0"), ("GLOO_SOCKET_IFNAME", "ib0")):
        monkeypatch.setenv(name, "")  # so monkeypatch restores (removes) what set_own writes
        set_own(name, value)
    set_own("GLOO_SOCKET_IFNAME", "eth9", default=True)  # already ours: a default changes nothing
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"
    (tmp_path / "envdump.py").write_text(
        "import json, os, sys, time\n"
        f"open({str(tmp_path / 'env.json')!r}, 'w').write(json.dumps(dict(os.environ)))\n"
        "time.sleep(60)\n")
    server = start_vllm_server(sys.executable, "m", entrypoint="envdump",
                               env={"PYTHONPATH": str(tmp_path), "NCCL_SOCKET_IFNAME": "eth1"},
                               log_path=tmp_path / "log", wait=False)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "env.json").exists():
            assert time.monotonic() < deadline and server.proc.poll() is None, (tmp_path / "log").read_text()
            time.sleep(0.1)
        time.sleep(0.2)
        seen = json.loads((tmp_path / "env.json").read_text())
    finally:
        server.stop()
    for name in ("LOCAL_RANK", "RANK", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_DUMP_ON_TIMEOUT", RECORD):
        assert name not in seen, name
    assert seen["NCCL_IB_HCA"] == "mlx5_0"  # the site's own
    assert seen["NCCL_SOCKET_IFNAME"] == "eth1"  # verifier.env is applied last
