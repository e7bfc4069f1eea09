"""One rank of the streaming tests: trainer ranks [0, T), streamer ranks [T, T+V)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

from hpc.fsio import write_text


def main(rank: int, n_trainers: int, n_streamers: int, port: int, target_dir: str, out_dir: str,
         n_rows: int, peer_timeout_s: float = 30.0, corrupt_id: int = -1, steps: int = 1000,
         nccl_timeout_s: float | None = None, stall_after: int = -1, groups: int = 1,
         lrs: list[float] | None = None, die_at: dict[int, int] | None = None) -> None:
    torch.set_num_threads(1)  # several ranks share 2 cores: no OpenMP oversubscription
    from hpc.config.schema import StreamConfig
    from hpc.dist.world import World, init_world
    from hpc.train.streamer_rank import streamer_rows
    from hpc.train.trainer import Trainer
    from hpc.train.trainer_rank import run_trainer
    from tests.train.test_resume import make_parts, rows

    w = World(rank, n_trainers, n_streamers, groups)
    planes = init_world(w, "gloo", "cpu", "127.0.0.1", port, "stream-test-" + "0" * 52, timeout_s=120,
                        data_timeout_s=nccl_timeout_s)
    out = Path(out_dir)
    stream_cfg = StreamConfig(buffer_per_trainer=3, heartbeat_s=0.5, peer_timeout_s=peer_timeout_s)
    data = rows(n_rows)
    code = 0
    if w.is_trainer:
        if groups > 1:  # each group trains its own draft, into its own directory
            out = out / f"group{w.group}"
            out_dir = str(out)
        extra = {"lr": lrs[w.group]} if lrs else {}
        cfg, model, head, export = make_parts(target_dir, init_seed=0, steps=steps, checkpoint_interval=2, **extra)
        depth = []

        def on_step(step, metrics):
            depth.append(metrics["stream_buffered"])
            write_text(out / f"progress{rank}", str(step))  # atomic: the test polls it
            if (die_at or {}).get(rank) == step:  # a trainer killed mid-stream (the OOM killer's way)
                os.kill(os.getpid(), signal.SIGKILL)

        # no epoch_size: the ledger keeps every pair
        trainer = Trainer(cfg, model, head, export, out_dir, group=planes.train_data, control_group=planes.train_control)
        trainer.resume()
        code = run_trainer(w, planes, trainer, stream_cfg, out_dir, on_step=on_step)
        from hpc.formats.checkpoint_layout import latest_checkpoint
        ckpt = latest_checkpoint(Path(out_dir) / "checkpoints")
        state = json.loads((ckpt / "state.json").read_text()) if ckpt else {}
        (out / f"trainer{rank}.json").write_text(json.dumps(
            {"code": code, "ledger": state.get("ledger", []), "max_depth": max(depth, default=0),
             "losses": [float(x).hex() for x in state.get("losses", [])],
             "step": state.get("step", 0), "seen": state.get("samples_seen", 0),
             "skipped": state.get("samples_skipped", 0)}))
    else:
        from hpc.stream.streamer import run_streamer
        from hpc.verifier.hf_backend import HFVerifier

        if stall_after >= 0:  # a peer that stops mid-sample: header and ids go out, the states never do
            from hpc.stream.sender import SampleSender

            real_send, sent = SampleSender.send_many, [0]

            def stalling_send(self, cap, epoch, dsts):
                if sent[0] == stall_after:
                    import time

                    import torch.distributed as dist

                    from hpc.dist import rules
                    from hpc.stream.protocol import DTYPE_CODES, Header, Kind
                    T, n_aux, H = cap.aux_TnH.shape
                    self.control(Header(Kind.SAMPLE, cap.sample_id, T, n_aux, H, epoch, DTYPE_CODES[self.dtype]), dsts[0])
                    with rules.message(rules.Message.SAMPLE):
                        dist.send(self.planes.place(torch.stack([cap.input_ids_T.long(), cap.loss_mask_T.long()])),
                                  dst=dsts[0], group=self.planes.data)
                    time.sleep(3600)  # alive, heartbeating, holding the sample: only a timeout ends the wait
                sent[0] += 1
                return real_send(self, cap, epoch, dsts)
            SampleSender.send_many = stalling_send  # type: ignore[method-assign]

        verifier = HFVerifier(target_dir, [1, 2, 3])

        def capture(sample_id, ids, mask):
            if sample_id == corrupt_id:
                raise ValueError("truncated capture file")
            return verifier.capture(sample_id, ids, mask)
        stats = run_streamer(streamer_rows(data, w, seed=3, epochs=1), capture, planes, torch.float32,
                             prefetch=2, heartbeat_s=stream_cfg.heartbeat_s, groups=w.trainer_groups)
        (out / f"streamer{rank}.json").write_text(json.dumps(
            {"sent": stats.sent, "failed": stats.failed, "per_trainer": stats.per_trainer, "skipped": stats.skipped,
             "dropped": stats.dropped}))
    os._exit(code)  # a dead peer can leave gloo's teardown waiting forever
