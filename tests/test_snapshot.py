from engine_server import snapshot


def test_snapshot_is_up_to_date():
    assert snapshot.stale() == [], "run `tkcc snapshot regenerate`"


def test_links_leaving_the_snapshot_are_refused(tmp_path):
    root = tmp_path / "snap"
    root.mkdir()
    (root / "ok.py").write_text("x = 1\n")
    (tmp_path / "secret.py").write_text("token = 1\n")
    (root / "link.py").symlink_to(tmp_path / "secret.py")
    assert snapshot.read(root, "ok.py")["ok"]
    assert not snapshot.read(root, "link.py")["ok"]
    assert "leaves" in snapshot.read(root, "link.py")["error"]
