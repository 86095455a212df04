"""The store verbs through the console script (a real subprocess, as users run it)."""

from __future__ import annotations

import json
import subprocess

from tests.support.stores import write_store


def test_info_json_has_the_keys_scripts_rely_on(tmp_path):
    url = str(tmp_path / "store")
    write_store(url, num_samples=5, codec="fp8_e4m3", compression="blosc")
    out = subprocess.run(["hsstore", "info", url, "--json"], capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert info["num_samples"] == 5 and info["num_tokens"] > 0
    assert info["bytes_per_token"] > 0
    assert info["features"]["final_hidden_state"]["shape"] == ["num_tokens", 16]
    assert info["lineage"]["aux_layer_ids"] == [2, 4, 5]
    human = subprocess.run(["hsstore", "info", url], capture_output=True, text=True, check=True).stdout
    assert "bytes/token" in human and "aux_hidden_states" in human


def test_missing_store_exits_nonzero_with_the_url(tmp_path):
    out = subprocess.run(["hsstore", "info", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert out.returncode == 1
    assert "no committed store here" in out.stderr and "nothing" in out.stderr
    out = subprocess.run(["hsstore", "verify", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert out.returncode == 1 and "manifest: manifest.json: not found" in out.stdout
