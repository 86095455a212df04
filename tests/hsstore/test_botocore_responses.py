"""hsstore.errors.botocore_responses: the responses along an error's chain of causes, once each."""

from __future__ import annotations

from hsstore.errors import botocore_responses


class _ClientError(Exception):
    def __init__(self, response: dict) -> None:
        super().__init__("client error")
        self.response = response


def test_responses_come_outermost_first_and_a_looping_chain_ends() -> None:
    inner = _ClientError({"ResponseMetadata": {"HTTPStatusCode": 412}})
    outer = OSError("translated by s3fs")
    outer.__cause__ = inner
    inner.__context__ = outer  # a loop: each exception is visited once
    assert list(botocore_responses(outer)) == [inner.response]
    top = _ClientError({"BucketRegion": "eu-west-1"})
    top.__cause__ = outer
    assert [r.get("BucketRegion") for r in botocore_responses(top)] == ["eu-west-1", None]
    assert list(botocore_responses(ValueError("no response anywhere"))) == []
