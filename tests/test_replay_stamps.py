"""replay of a log whose recorded time cannot be trusted: one absurd stamp, a stamp going back."""

from __future__ import annotations

import subprocess
import sys

from estimator_service import bus, schema
from estimator_service.logfile import LogWriter
from estimator_service.rig import load_rig
from helpers import RIG


def _imu(seq: int, t: float) -> bytes:
    return schema.encode("imu/coupler", {"t": t, "seq": seq, "gyr": [0.0, 0.0, 0.1], "acc": [0.0, 9.81, 0.0]})


def test_replay_paced_through_an_absurd_stamp_publishes_everything_and_ends(tmp_path, endpoint):
    """Message 100 says t = 1e9 s (an imported table's typo), message 200 goes back by 0.5 s: the paced
    replay publishes all 300 in log order and ends (it used to wait 1e9 s), and says it shortened two steps
    (to the absurd stamp, and from message 200 back to the log's own time)."""
    log_path = tmp_path / "absurd.rslog"
    times = [i * 0.002 for i in range(300)]
    times[100] = 1e9
    times[200] -= 0.5
    with LogWriter(log_path, load_rig(RIG).header()) as w:
        for i, t in enumerate(times):
            w.write("imu/coupler", t, _imu(i, t))
    with bus.Subscriber(endpoint, topics=["imu/"]) as sub:
        proc = subprocess.Popen([sys.executable, "-m", "estimator_service.cli", "replay", str(log_path),
                                 "--endpoint", endpoint, "--max-gap-s", "0.05", "--wait-s", "60"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        try:
            seqs = []
            while len(seqs) < len(times):
                m = sub.recv(120.0)  # bounded: a replay stuck on the absurd stamp fails here
                assert m is not None, f"replay stalled after {len(seqs)} messages"
                seqs.append(schema.decode(m[0], m[1])["seq"])
            stdout, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == 0
    assert seqs == list(range(len(times)))
    assert f"replayed {len(times)} of {len(times)} messages" in stdout
    assert "2 step(s) of recorded time beyond 0.05 s shortened to it" in stdout


def test_replay_refuses_a_non_positive_max_gap(tmp_path):
    res = subprocess.run([sys.executable, "-m", "estimator_service.cli", "replay", str(tmp_path / "x.rslog"),
                          "--max-gap-s", "0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--max-gap-s: must be > 0, got 0.0" in res.stderr
