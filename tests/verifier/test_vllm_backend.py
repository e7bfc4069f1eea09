"""The vLLM capture backend: same tensors as the in-process HF backend, files cleaned up, clear errors.

One capture server for the module (~30-100 s to start on 2 shared cores); the fast tests above
the server ones need no vLLM.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hpc.config.schema import FinalHidden, VerifierConfig
from hpc.data.sources import to_messages, tokenize_conversation
from hpc.errors import UserError, VerifierDown
from hpc.model.teacher import target_transform
from hpc.net import free_port
from hpc.verifier import vllm_backend
from hpc.verifier.hf_backend import HFVerifier
from hpc.verifier.target_files import final_norm_weight, text_config
from hpc.verifier.vllm_backend import (
    CaptureError,
    VLLMVerifier,
    capture_layer_ids,
    read_capture,
    server_args,
    start_capture_server,
)
from hpc_dev.toy_data import toy_conversations
from tests.fixtures.infra import infra_unavailable
from tests.fixtures.sockets import listening_addresses

# Unsorted and holding the final layer (id == num layers = 4): vLLM returns its ids sorted and
# de-duplicated, so this exercises the column mapping.
AUX = [3, 1, 4]
ATOL = 1e-4  # fp32 on CPU; measured ~1e-5


# ---------------- no server needed ----------------

def test_capture_ids_add_the_final_layer_sorted():
    assert capture_layer_ids([3, 1, 4], 4) == [1, 3, 4]
    assert capture_layer_ids([1, 29, 57], 61) == [1, 29, 57, 61]
    with pytest.raises(UserError, match="outside 0..4"):
        capture_layer_ids([5], 4)


def test_server_args_name_the_capture_method_and_our_connector(tmp_path):
    cfg = VerifierConfig(extra_args=["--enforce-eager"])
    args = server_args(cfg, [1, 29, 57, 61], tmp_path)
    joined = " ".join(args)
    assert '"method": "extract_hidden_states"' in joined
    assert '"eagle_aux_hidden_state_layer_ids": [1, 29, 57, 61]' in joined
    assert f'"kv_connector_module_path": "{vllm_backend.CONNECTOR_MODULE}"' in joined
    assert f'"capture_dir": "{tmp_path}"' in joined
    assert args[-1] == "--enforce-eager", "the user's extra args come last, so they win"
    # The connector module runs in vLLM's venv: our names for it must match its source.
    source = vllm_backend.CONNECTOR_FILE.read_text()
    assert f"class {vllm_backend.CONNECTOR_CLASS}(" in source
    assert f'PATH_KEY = "{vllm_backend.PATH_KEY}"' in source
    imports = [ln for ln in source.splitlines() if ln.startswith(("import ", "from "))]
    assert not [ln for ln in imports if "hpc" in ln], "the connector must not import the rest of hpc"
    assert f"from {vllm_backend.COPY_MODULE} import" in source
    helper = [ln for ln in vllm_backend.COPY_FILE.read_text().splitlines() if ln.startswith(("import ", "from "))]
    assert {ln.split()[1] for ln in helper} <= {"__future__", "threading", "torch"}, helper


def test_corrupt_or_truncated_file_is_a_clear_per_sample_error(tmp_path):
    path = tmp_path / "c.safetensors"
    save_file({"hidden_states": torch.randn(6, 2, 8), "token_ids": torch.arange(6)}, str(path))
    assert read_capture(path, 1, list(range(6)), 2, 8).shape == (6, 2, 8)
    with pytest.raises(CaptureError, match="expected"):
        read_capture(path, 1, list(range(6)), 3, 8)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CaptureError, match=r"sample 1: .* truncated or corrupt"):
        read_capture(path, 1, list(range(6)), 2, 8)


def test_a_capture_that_only_ran_out_of_time_is_tried_again_while_the_server_is_alive(monkeypatch, capsys):
    """A loaded server answered late: the sample is not its fault, so it is captured again until
    verifier.capture_retry_s has passed, rather than skipped (a skipped sample is never trained).
    Other failures are not retried, and a server that went away ends the stream instead."""
    clock = [0.0]
    monkeypatch.setattr(vllm_backend.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(vllm_backend.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    v = VLLMVerifier.__new__(VLLMVerifier)  # the capture loop only; the server is what is faked
    v.cfg = VerifierConfig(capture_retry_s=60.0)
    v.layer_ids, v.aux_layer_ids, v.n_layers, v.norm_weight = [1, 2], [1], 2, None
    monkeypatch.setattr(v, "down", lambda: None, raising=False)
    calls: list[float] = []

    def states(why: str, transient: bool, ok_after: int | None = None, request_s: float = 4.8):
        def fn(sample_id, ids):
            calls.append(clock[0])
            if ok_after is not None and len(calls) > ok_after:
                return torch.randn(len(ids), 2, 4)
            clock[0] += request_s  # the request's own timeout
            raise CaptureError(f"sample {sample_id}: {why}", transient=transient)
        return fn

    # Late six times (more than any fixed small count of tries), then answered.
    monkeypatch.setattr(v, "_states", states("read timed out", True, ok_after=6), raising=False)
    cap = v.capture(7, [1, 2, 3], [0, 1, 1])
    assert len(calls) == 7 and cap.sample_id == 7 and cap.aux_TnH.shape == (3, 1, 4)
    assert capsys.readouterr().out.count("trying again") == 6

    calls.clear()
    clock[0] = 0.0
    monkeypatch.setattr(v, "_states", states("read timed out", True), raising=False)
    with pytest.raises(CaptureError, match="timed out"):  # always late: given up once the budget is spent
        v.capture(8, [1, 2], [0, 1])
    assert 60.0 <= clock[0] <= 60.0 + 4.8 and calls[-1] <= 60.0  # no try starts past the budget

    calls.clear()
    monkeypatch.setattr(v, "_states", states("vLLM answered 400", False), raising=False)
    with pytest.raises(CaptureError, match="400"):  # the sample's own fault: once
        v.capture(9, [1, 2], [0, 1])
    assert len(calls) == 1

    calls.clear()
    monkeypatch.setattr(v, "down", lambda: VerifierDown("vLLM exited with code -9"), raising=False)
    monkeypatch.setattr(v, "_states", states("unreachable", True), raising=False)
    with pytest.raises(VerifierDown, match="-9"):  # the server died: no retry, the stream ends
        v.capture(10, [1, 2], [0, 1])
    assert len(calls) == 1


def test_norm_from_safetensors_matches_hf(toy_target):
    # post_norm in the vLLM backend = our RMSNorm with the weight read from the checkpoint.
    hf = HFVerifier(str(toy_target), [1], final_hidden="post_norm")
    x = torch.randn(5, int(text_config(toy_target)["hidden_size"]))
    weight = final_norm_weight(toy_target)
    assert torch.equal(weight, hf.model.model.norm.weight.detach())
    assert torch.allclose(target_transform(toy_target).final_norm(x, weight), hf.model.model.norm(x), atol=1e-6)


@pytest.mark.slow
def test_deepseek_toy_captures_through_hf(toy_deepseek):
    # Kimi's architecture (MLA + MoE). vLLM's DeepseekV3 numerics differ from HF's, so only
    # the HF path is checked here: shapes, finite values, and our norm reproducing HF's.
    n_layers = int(text_config(toy_deepseek)["num_hidden_layers"])
    aux = [1, n_layers]
    pre = HFVerifier(str(toy_deepseek), aux, final_hidden="pre_norm").capture(0, list(range(10, 50)), [1] * 40)
    post = HFVerifier(str(toy_deepseek), aux, final_hidden="post_norm").capture(0, list(range(10, 50)), [1] * 40)
    hidden = int(text_config(toy_deepseek)["hidden_size"])
    assert pre.aux_TnH.shape == (40, 2, hidden) and post.last_hidden_TH.shape == (40, hidden)
    assert torch.isfinite(pre.aux_TnH).all() and torch.isfinite(post.last_hidden_TH).all()
    ours = target_transform(toy_deepseek).final_norm(pre.last_hidden_TH, final_norm_weight(toy_deepseek))
    print(f"deepseek toy: post-norm ours vs HF max abs diff {(ours - post.last_hidden_TH).abs().max():.2e}")
    assert torch.allclose(ours, post.last_hidden_TH, atol=1e-5)


# ---------------- one real vLLM server ----------------

@pytest.fixture(scope="module")
def capture_cfg(vllm_python, toy_target, tmp_path_factory) -> VerifierConfig:
    return VerifierConfig(
        model=str(toy_target), python=str(vllm_python), trust_remote_code=False, aux_layer_ids=AUX,
        dtype="float32", tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=512,
        # Small prefill chunks, so a long sample is captured across several engine steps (as a
        # 20k-token Kimi sample is with the default budget).
        extra_args=["--enforce-eager", "--max-num-batched-tokens", "128"], compilation_config={},
        host="127.0.0.1", port=free_port(),
        capture_dir=str(tmp_path_factory.mktemp("captures")), health_timeout_s=420)


@pytest.fixture(scope="module")
def capture_server(capture_cfg, tmp_path_factory):
    """Its own server, not the shared one: hidden-state capture, fp32 and 128-token prefill chunks."""
    log = tmp_path_factory.mktemp("vllm-capture") / "server.log"
    try:
        server = start_capture_server(capture_cfg, log_path=log)
    except UserError as err:
        infra_unavailable(f"vLLM capture server did not start: {err}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def samples(toy_target) -> list[tuple[list[int], list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_target)
    rows = [tokenize_conversation(tok, to_messages(r)) for r in toy_conversations(3, seed=5)]
    rows.append(((rows[0][0] * 4)[:450], (rows[0][1] * 4)[:450]))  # > 128: prefilled in 4 chunks

    return rows


@pytest.mark.slow
@pytest.mark.parametrize("final_hidden", [FinalHidden.post_norm, FinalHidden.pre_norm])
def test_vllm_capture_matches_hf(capture_server, capture_cfg, toy_target, samples, final_hidden):
    cfg = dataclasses.replace(capture_cfg, final_hidden=final_hidden)
    vllm = VLLMVerifier(cfg, server=capture_server)
    hf = HFVerifier(str(toy_target), AUX, final_hidden=final_hidden.value)
    worst_aux = worst_last = 0.0
    for sid, (ids, mask) in enumerate(samples):
        got, want = vllm.capture(sid, ids, mask), hf.capture(sid, ids, mask)
        assert got.sample_id == sid and got.input_ids_T.tolist() == ids and got.loss_mask_T.tolist() == mask
        got.check(len(AUX), vllm.hidden)
        worst_aux = max(worst_aux, (got.aux_TnH - want.aux_TnH).abs().max().item())
        worst_last = max(worst_last, (got.last_hidden_TH - want.last_hidden_TH).abs().max().item())
        assert not list(capture_server.capture_dir.iterdir()), "the capture file must be deleted once read"
    lengths = [len(ids) for ids, _ in samples]
    print(f"{final_hidden.value}: lengths {lengths}, max abs diff vLLM vs HF: aux {worst_aux:.2e}, "
          f"last {worst_last:.2e}")
    assert worst_aux < ATOL and worst_last < ATOL
    vllm.close()
    assert capture_server.server.healthy(), "a verifier given a server must not stop it"


@pytest.mark.slow
def test_requests_in_flight_capture_the_same_states(capture_server, capture_cfg, samples):
    # verifier.capture_concurrency: several threads share one verifier; vLLM batches their prefills.
    from concurrent.futures import ThreadPoolExecutor

    vllm = VLLMVerifier(capture_cfg, server=capture_server)
    one_by_one = [vllm.capture(i, ids, mask) for i, (ids, mask) in enumerate(samples)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda i: vllm.capture(i, *samples[i]), range(len(samples))))
    for a, b in zip(one_by_one, together):
        assert a.sample_id == b.sample_id and torch.equal(a.input_ids_T, b.input_ids_T)
        assert (a.aux_TnH - b.aux_TnH).abs().max() < ATOL and (a.last_hidden_TH - b.last_hidden_TH).abs().max() < ATOL
    assert len(vllm._sessions) >= 2  # one HTTP session per capturing thread
    assert not list(capture_server.capture_dir.iterdir())
    vllm.close()


@pytest.mark.slow
def test_truncated_capture_file_fails_that_sample_only(capture_server, capture_cfg, samples, monkeypatch):
    vllm = VLLMVerifier(capture_cfg, server=capture_server)
    real_wait = vllm_backend.wait_for_file
    seen: list[Path] = []

    def wait_then_truncate(path: Path, timeout: float) -> None:
        real_wait(path, timeout)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # what a full disk leaves
        seen.append(path)

    monkeypatch.setattr(vllm_backend, "wait_for_file", wait_then_truncate)
    ids, mask = samples[0]
    with pytest.raises(CaptureError, match=r"sample 7: capture file .* is truncated or corrupt"):
        vllm.capture(7, ids, mask)
    assert seen and not seen[0].exists(), "a bad file is deleted too (node RAM)"
    monkeypatch.setattr(vllm_backend, "wait_for_file", real_wait)
    assert vllm.capture(8, ids, mask).aux_TnH.shape[0] == len(ids), "the next sample is unaffected"


@pytest.mark.slow
def test_capture_paths_outside_our_directory_are_neither_read_nor_deleted(capture_server, capture_cfg, tmp_path):
    vllm = VLLMVerifier(capture_cfg, server=capture_server)
    victim = tmp_path / "someone-elses.safetensors"
    victim.write_bytes(b"x")
    for reported in (str(victim), str(capture_server.capture_dir / ".." / victim.name),
                     str(capture_server.capture_dir / "sub" / "a.safetensors")):
        with pytest.raises(CaptureError, match="outside this job's capture directory"):
            vllm._own_capture_path(1, reported)
    assert victim.exists()
    (capture_server.capture_dir / "link.safetensors").symlink_to(victim)
    with pytest.raises(CaptureError):
        vllm._own_capture_path(1, str(capture_server.capture_dir / "link.safetensors"))
    (capture_server.capture_dir / "link.safetensors").unlink()
    assert capture_server.capture_dir.stat().st_mode & 0o777 == 0o700
    assert capture_server.capture_dir.parent == Path(capture_cfg.capture_dir)
    vllm.close()


@pytest.mark.slow
def test_overlong_sample_is_refused_before_vllm(capture_server, capture_cfg):
    vllm = VLLMVerifier(capture_cfg, server=capture_server)
    with pytest.raises(CaptureError, match="at most 511"):
        vllm.capture(3, [11] * capture_cfg.max_model_len, [1] * capture_cfg.max_model_len)


@pytest.mark.slow
def test_capture_server_binds_loopback_only(capture_server):
    assert "--host" in capture_server.server.proc.args
    assert listening_addresses(capture_server.server.port) == {"127.0.0.1"}


def test_each_capture_server_gets_its_own_private_directory(tmp_path):
    from hpc.verifier.vllm_backend import private_capture_dir

    a, b = private_capture_dir(tmp_path, 8000), private_capture_dir(tmp_path, 8000)  # same port, two jobs
    assert a != b and a.parent == b.parent == tmp_path
    assert a.stat().st_mode & 0o777 == 0o700 and a.stat().st_uid == os.getuid()
    with pytest.raises(UserError, match="verifier.capture_dir"):
        private_capture_dir(tmp_path / "missing", 8000)
    # A base others may write without the sticky bit: they could rename our 0700 directory away
    # and put theirs in its place, and vLLM would write captures where they read.
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(UserError, match=r"verifier.capture_dir = .*open.*writable by other users .*without the sticky"):
        private_capture_dir(open_dir, 8000)
    os.chmod(open_dir, 0o1777)  # /dev/shm's mode: each user's entries are their own
    assert private_capture_dir(open_dir, 8000).parent == open_dir
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UserError, match="belongs to uid 65534"):
        private_capture_dir(theirs, 8000)


def test_a_capture_file_that_lands_after_the_wait_gave_up_is_deleted(tmp_path):
    """The connector writes after its response; a file landing after file_timeout_s sat in node
    RAM (/dev/shm) until the server stopped, about a gigabyte per Kimi sample."""
    import threading

    from hpc.verifier.vllm_backend import CaptureError, VLLMVerifier

    v = object.__new__(VLLMVerifier)  # the capture path only: no server
    v.file_timeout_s, v.layer_ids, v.hidden = 0.2, [1, 2], 4
    v._abandoned, v._abandoned_lock = vllm_backend.deque(maxlen=16), threading.Lock()
    v._sessions, v.owns_server = [], False
    v.cfg = VerifierConfig(capture_retry_s=1e-6)  # one try: the late file is what is tested
    late = tmp_path / "cmpl-1-0.safetensors"
    v._prefill = lambda sid, ids: late
    v.down = lambda: None  # healthy: the sample's failure, not the server's
    with pytest.raises(CaptureError, match="did not appear"):
        v.capture(0, [0, 1, 2], [0, 1, 1])
    save_file({"hidden_states": torch.zeros(3, 2, 4), "token_ids": torch.arange(3)}, str(late))  # it lands now
    v._prefill = lambda sid, ids: tmp_path / "cmpl-2-0.safetensors"
    with pytest.raises(CaptureError):
        v.capture(1, [0, 1, 2], [0, 1, 1])  # the next capture sweeps the late one away
    assert not late.exists()
    (tmp_path / "cmpl-2-0.safetensors").write_bytes(b"")
    v.close()
    assert list(tmp_path.iterdir()) == []
