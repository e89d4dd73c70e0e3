"""The storage root: gs://bucket/p maps under it, and nothing a client names leads out of it."""

from __future__ import annotations

import os

import pytest

from pathways_nb.core.storage import StorageRoot, check_location
from pathways_nb.protocol.errors import InvalidRequest, PermissionDenied


def test_a_bucket_path_maps_under_the_root(tmp_path):
    storage = StorageRoot(tmp_path / "root")
    assert storage.resolve("gs://bucket/run/a") == (tmp_path / "root" / "bucket" / "run" / "a").resolve()
    made = storage.directory("gs://my-bucket.example/p")
    assert made.is_dir() and made.parent.name == "my-bucket.example"


def test_a_local_path_is_accepted_only_inside_the_root(tmp_path):
    storage = StorageRoot(tmp_path / "root")
    inside = tmp_path / "root" / "runs"
    assert storage.resolve(str(inside)) == inside.resolve()
    with pytest.raises(PermissionDenied, match="outside this server's storage root"):
        storage.resolve(str(tmp_path / "elsewhere"))
    with pytest.raises(PermissionDenied, match="outside"):
        storage.resolve("/etc")


@pytest.mark.parametrize(
    "location, words",
    [
        ("", "empty"),
        ("gs://b/../../etc", "'..'"),
        ("gs://bucket/a/./b", "'..'"),
        ("/root/../etc", "'..'"),
        ("relative/path", "relative"),
        ("s3://bucket/p", "only gs://"),
        ("gs://Bad_Bucket!/p", "bucket name"),
        ("gs://ab/p", "bucket name"),
        ("gs://bucket/" + "x" * 5000, "characters"),
        ("gs://bucket/a\0b", "NUL"),
    ],
)
def test_malformed_locations_are_refused_with_the_reason(location, words):
    with pytest.raises(InvalidRequest, match=words):
        check_location(location)


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "bucket")
    storage = StorageRoot(root)
    with pytest.raises(PermissionDenied, match="symbolic link"):
        storage.resolve("gs://bucket/run")
    with pytest.raises(PermissionDenied):
        storage.directory("gs://bucket/run/deeper")
    assert not (outside / "run").exists()


def test_write_replaces_a_symlink_instead_of_following_it(tmp_path):
    storage = StorageRoot(tmp_path / "root")
    directory = storage.directory("gs://bucket/run")
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.symlink(victim, directory / "file.pb")
    storage.write(directory, "file.pb", b"new")
    assert victim.read_bytes() == b"keep"
    assert (directory / "file.pb").read_bytes() == b"new" and not (directory / "file.pb").is_symlink()
    with pytest.raises(InvalidRequest):
        storage.write(directory, "../escape", b"x")
