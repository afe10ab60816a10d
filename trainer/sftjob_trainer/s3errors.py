"""Which object-storage failures a retry can fix, stated once for every S3 path of the trainer.

The model download and checkpoint I/O go through boto3, the data reads through pyarrow's
S3 filesystem; both end up here, so a refused connection, a timeout, a 5xx or throttling
(``503 SlowDown``) is always retried and then reported as ``StorageUnavailable`` (exit 1: a
gang restart may help), and a denied request, a missing bucket or key always fails at once
as ``StorageDenied`` (exit 2: the spec must change), naming the spec field that holds the URI.

pyarrow raises a plain ``OSError`` whose text carries the AWS error ("AWS Error SLOW_DOWN
during GetObject operation ..."); botocore raises typed exceptions, often wrapped (boto3's
``S3UploadFailedError`` only keeps the ``ClientError`` as its context). Codes are compared
without case and underscores, so ``SLOW_DOWN`` and ``SlowDown`` are one code.
"""
from __future__ import annotations

import os
import random
import re
from collections.abc import Iterator

from sftjob_contract import env as E

from .errors import StorageDenied, StorageUnavailable, TrainerError
from .s3settings import S3Settings

TRANSIENT, PERMANENT, UNKNOWN = "transient", "permanent", "unknown"

_TRANSIENT_CODES = frozenset(c.upper() for c in (
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "RequestLimitExceeded", "TooManyRequestsException", "BandwidthLimitExceeded",
    "ProvisionedThroughputExceededException", "RequestTimeout", "RequestTimeoutException", "RequestExpired",
    "InternalError", "InternalFailure", "ServiceUnavailable", "ServiceUnavailableException",
    "XMinioServerNotInitialized", "NetworkConnection", "PriorRequestNotComplete", "EC2ThrottledException",
))
_PERMANENT_CODES = frozenset(c.upper() for c in (
    "AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "InvalidSecurity", "MissingSecurityHeader", "InvalidBucketName",
    "NoSuchBucket", "NoSuchKey", "NotFound", "ResourceNotFound", "AuthorizationHeaderMalformed",
    "PermanentRedirect", "InvalidObjectState", "XMinioInvalidObjectName", "Forbidden", "Unauthorized",
))
# botocore's exceptions by class name, so this module needs neither boto3 nor pyarrow to import.
_TRANSIENT_TYPES = frozenset((
    "EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectionError", "HTTPClientError", "ProxyConnectionError", "IncompleteReadError",
    "ResponseStreamingError", "ChecksumError", "ProtocolError", "ConnectionRefusedError",
    "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError", "TimeoutError", "timeout",
))
_PERMANENT_TYPES = frozenset(("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                              "NoSuchBucket", "NoSuchKey"))
_ARROW_ERROR = re.compile(r"AWS Error (\w+)(?: \(HTTP status (\d+)\))?")


def _norm(code: str) -> str:
    return code.replace("_", "").upper()


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _from_status(status: int | None) -> str | None:
    if status is None:
        return None
    if status >= 500 or status in (408, 429):
        return TRANSIENT
    if status in (401, 403, 404):
        return PERMANENT
    return None


def _from_code(code: str | None, status: int | None) -> str | None:
    if code:
        code = _norm(code)
        if code in _TRANSIENT_CODES:
            return TRANSIENT
        if code in _PERMANENT_CODES:
            return PERMANENT
        if code.isdigit():  # HeadObject has no body, so botocore's code is the status ("403")
            status = status or int(code)
    return _from_status(status)


def kind(err: BaseException) -> str:
    """TRANSIENT (retry), PERMANENT (the URI or the credentials are wrong) or UNKNOWN."""
    for e in _chain(err):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:  # botocore ClientError
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            found = _from_code(response["Error"].get("Code"), status)
            if found:
                return found
        name = type(e).__name__
        if name in _TRANSIENT_TYPES:
            return TRANSIENT
        if name in _PERMANENT_TYPES:
            return PERMANENT
        match = _ARROW_ERROR.search(str(e)) if isinstance(e, OSError) else None
        if match:
            found = _from_code(match.group(1), int(match.group(2)) if match.group(2) else None)
            if found:
                return found
    return UNKNOWN


def is_permanent(err: BaseException) -> bool:
    return kind(err) == PERMANENT


def is_storage_error(err: BaseException) -> bool:
    """Whether the error came from object storage at all (a corrupt file's OSError did not)."""
    return kind(err) != UNKNOWN or any(
        type(e).__module__.startswith(("botocore", "boto3", "s3transfer", "urllib3")) for e in _chain(err))


_USERINFO = re.compile(r"//[^/@\s\"']+@")


def describe(err: BaseException) -> str:
    """The error's text without credentials (an endpoint URL may carry user:password, and
    no message, log line or status may show the secret key or session token)."""
    text = str(err) if type(err) is OSError else f"{type(err).__name__}: {err}"  # pyarrow's text says enough
    text = _USERINFO.sub("//***@", text)
    for name in (E.AWS_SECRET_ACCESS_KEY, E.AWS_SESSION_TOKEN):
        secret = os.environ.get(name)
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def classify(err: BaseException, field: str, uri: str, what: str = "", tries: int | None = None) -> TrainerError:
    """The error that ends the run for ``err`` met while reading or writing ``uri`` (from ``field``),
    once ``tries`` attempts (default: ``attempts()``) were spent on a transient one."""
    doing = f" ({what})" if what else ""
    k = kind(err)
    if k == PERMANENT:
        return StorageDenied(
            f"{field} {uri}: object storage refused the request{doing}: {describe(err)}. Check the URI (bucket and "
            "prefix exist) and that the storage credentials may read and write it; retrying cannot help")
    if k == TRANSIENT:
        return StorageUnavailable(
            f"{field} {uri}: object storage still failing after {tries or attempts()} attempts{doing}: {describe(err)}")
    return TrainerError(f"{field} {uri}{doing}: {describe(err)}")


# --------------------------------------------------------------------------- how long to retry


def attempts() -> int:
    """Attempts per S3 store operation (s3settings: ``SFTJOB_S3_ATTEMPTS``, else 8, which with
    ``backoff`` between them ride out about 40 s of outage)."""
    return S3Settings.from_env().store_attempts()


def backoff(attempt: int, base: float = 0.5, cap: float = 10.0) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based): exponential with jitter, so
    the ranks of a large job that were throttled together do not all come back together."""
    return random.uniform(0.5, 1.0) * min(cap, base * 2 ** (attempt - 1))
