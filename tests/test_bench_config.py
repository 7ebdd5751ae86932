"""Every benchmark row states the configuration it ran in (compress / retain / budget / tier), read back from the
allocator: "default" where it is what a user gets, else what differs. Simulated device, smallest scale."""

from __future__ import annotations

import json

import pytest

from cumem_rs import Allocator
from cumem_rs.bench import config
from cumem_rs.bench import main as bench_main
from cumem_rs.workload import WEIGHTS_TAG


def test_the_label_names_what_differs_from_the_default():
    a = Allocator.simulated()
    try:
        assert config.describe(a).startswith("default: compress auto")
        a.set_retain_backups(False)
        assert config.describe(a) == "compress auto, retain off, budget none, host tier"
        a.set_retain_backups(True)
        a.set_host_budget(1 << 20)
        assert config.describe(a) == "compress auto, retain on, budget 1.00 MiB, host tier"
        a.set_host_budget(None)
        a.set_tag_policy(WEIGHTS_TAG, backup_tier="file", compress="off")
        assert config.describe(a) == "compress off, retain on, budget none, file tier"
    finally:
        a.close()




def test_short_says_default_or_only_the_differences():
    a = Allocator.simulated()
    try:
        assert config.short(a) == "default"
        a.set_retain_backups(False)
        a.set_tag_policy(WEIGHTS_TAG, compress="off")
        assert config.short(a) == "compress off, retain off"
        assert config.short(a, "kv_cache") == "retain off"  # policies are per tag
        a.set_verify_wakes(False)
        assert config.short(a) == "compress off, retain off, verify off"
        assert config.describe(a) == "compress off, retain off, budget none, host tier, verify off"
    finally:
        a.close()
    b = Allocator.simulated(compress=False)
    try:
        assert config.short(b) == "compress none (no codec)"
    finally:
        b.close()


@pytest.mark.usefixtures("codec_on")
def test_compress_rows_with_retention_off_say_so_and_the_default_rows_do_not(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_main(["--backend", "sim", "--scale", "4096", "--cycles", "1", "--only", "compress",
                       "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if not str(r["vs"]).startswith("skipped")]
    by_name = {r["name"]: r["config"] for r in rows}
    # The copy-everything settings: set_retain_backups(False), and compress off where the row says 'off'.
    steady = [n for n in by_name if n.startswith("sleep, bf16") and "compress='auto'" in n]
    assert steady and all(by_name[n] == "retain off" for n in steady)
    off = [n for n in by_name if n.startswith("sleep, bf16") and "compress='off'" in n]
    assert off and all(by_name[n] == "compress off, retain off" for n in off)
    # The retained compressed backups run as a user has them.
    kept = [n for n in by_name if n.startswith("sleep, retained compressed backups")]
    assert kept and all(by_name[n] == "default" for n in kept)
    # Every row of the table states one; only the plain copies (the limit) have none.
    assert all(r["config"] for r in rows if "limit" not in r["table"]), [r["name"] for r in rows if not r["config"]]
