import pytest

from mgrpo_jax.store import open_store, parse_store_url


@pytest.mark.parametrize(
    ("url", "scheme", "bucket", "root"),
    [
        ("memory://", "memory", "", "default/"),
        ("memory://run1", "memory", "", "run1/"),
        ("memory://run1/a/b/", "memory", "", "run1/a/b/"),
        ("file:///tmp/x/store", "file", "", "/tmp/x/store/"),
        ("file://localhost/tmp/x", "file", "", "/tmp/x/"),
        ("gs://my-bucket/runs/exp1", "gs", "my-bucket", "runs/exp1/"),
        ("gs://my-bucket", "gs", "my-bucket", ""),
        ("GS://my-bucket/p", "gs", "my-bucket", "p/"),
    ],
)
def test_parse_valid(url, scheme, bucket, root):
    loc = parse_store_url(url)
    assert (loc.scheme, loc.bucket, loc.root) == (scheme, bucket, root)
    assert loc.url.endswith("/")


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("", "non-empty"),
        ("/tmp/store", "no scheme"),
        ("s3://bucket/x", "unknown scheme 's3'"),
        ("http://host/x", "unknown scheme"),
        ("file://otherhost/tmp/x", "absolute"),
        ("file:///", "root"),
        ("file:///tmp/../etc", "'..'"),
        ("gs:///prefix", "bucket"),
        ("gs://Bad_Bucket/x", "bucket"),
        ("gs://b/x?y=1", "query"),
        ("memory://a b", "segment"),
    ],
)
def test_parse_invalid(url, fragment):
    with pytest.raises(ValueError) as info:
        parse_store_url(url)
    assert fragment in str(info.value)
    if url:
        assert repr(url) in str(info.value)


def test_open_store_rejects_non_string():
    with pytest.raises(ValueError, match="non-empty string"):
        open_store(None)
