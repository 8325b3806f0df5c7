"""Smoke test of benchmarks/disk_streams.py on the test Llama's first file, so the harness cannot rot: every case
runs, the table has one row each, and the storage line is the file's kind."""

from __future__ import annotations

import os
import re

from benchmarks import disk_streams
from raylazy.storage.kinds import storage_kind


def test_every_case_reads_the_file_and_the_kind_is_said(llama_dir, capsys):
    path = os.path.join(llama_dir, sorted(f for f in os.listdir(llama_dir) if f.endswith(".safetensors"))[0])
    assert disk_streams.main(["--file", path, "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert f"storage: {storage_kind(path).describe()}" in out
    rows = re.findall(r"^\| (read|copies), ([^|]+) \| ([\d.]+) \([\d.]+-[\d.]+\) \| ([\d.]+) \|$", out, re.M)
    assert len(rows) == 9
