from engine_server import snapshot


def test_snapshot_is_up_to_date():
    assert snapshot.stale() == [], "run `tkcc snapshot regenerate`"


def snapshot_with_outside_link(tmp_path, link: str):
    """A snapshot holding ok.py (three lines) and `link`, a link to a file beside the snapshot."""
    root = tmp_path / "snap"
    root.mkdir()
    (root / "ok.py").write_text("a = 1\nb = 2\nc = 3\n")
    (tmp_path / "secret.py").write_text("token = 1\n")
    (root / link).symlink_to(tmp_path / "secret.py")
    return root


def test_links_leaving_the_snapshot_are_refused(tmp_path):
    root = snapshot_with_outside_link(tmp_path, "link.py")
    assert snapshot.read(root, "ok.py")["ok"]
    assert not snapshot.read(root, "link.py")["ok"]
    assert "leaves" in snapshot.read(root, "link.py")["error"]


def test_unreadable_entries_are_errors_and_stay_out_of_the_listing(tmp_path):
    root = snapshot_with_outside_link(tmp_path, "out.py")
    (root / "dangling.py").symlink_to(root / "gone.py")
    (root / "loop.py").symlink_to(root / "loop.py")
    (root / "latin1.py").write_bytes(b"x = '\xe9'\n")
    listing = snapshot.read(root)
    assert listing["ok"] and [f["path"] for f in listing["files"]] == ["ok.py"]
    for bad in ("out.py", "dangling.py", "loop.py", "latin1.py", "ok\x00.py", "x" * 5000 + ".py",
                "/".join(["d"] * 2000) + "/y.py"):
        r = snapshot.read(root, bad)
        assert not r["ok"] and r["error"] and len(r["error"]) < 400 and str(tmp_path) not in r["error"], (bad, r)
    # line ranges: a range holding no line of the file is an error, not an empty page
    assert snapshot.read(root, "ok.py", 2, 3)["text"].split("\n")[0].strip().startswith("2")
    assert not snapshot.read(root, "ok.py", 3, 2)["ok"]
    assert "3 lines" in snapshot.read(root, "ok.py", 10)["error"]
    assert not snapshot.read(root, "ok.py", 0)["ok"]
    assert not snapshot.read(root, "ok.py", 1, 0)["ok"]
    assert snapshot.read(root, "ok.py", 2)["end_line"] == 3
