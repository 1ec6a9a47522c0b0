"""TLS on the wire, optional: stdlib ``ssl`` contexts built from the ``tls_cert``,
``tls_key`` and ``tls_ca`` fields every service's and client's config shares
(:class:`kvfs.config.TlsConfig`), and what a failed TLS handshake means in words.

- A **server** given ``tls_cert`` speaks only TLS (1.2 or newer).  Given ``tls_ca``
  too, it requires a client certificate signed by those CAs (mutual TLS).
- A **client** given any of the three speaks only TLS: it verifies the server's
  certificate against ``tls_ca`` (else the system's CAs) and that the certificate
  names the host it dialled; ``tls_cert``/``tls_key`` are its own certificate for
  mutual TLS.  A client whose config names none of them reads
  ``$KVFS_TLS_CERT``/``$KVFS_TLS_KEY``/``$KVFS_TLS_CA`` instead (services never do).
- Neither side ever falls back to plaintext: a TLS client meeting a plaintext server,
  or a plaintext client meeting a TLS server, fails within the handshake timeout with
  an error that says so.

The token handshake (:mod:`kvfs.handshake`) runs unchanged inside TLS.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

from kvfs.config import TlsConfig
from kvfs.errors import InvalidArgument, KVFSError, TlsError, Unavailable

TLS_ENV = {"tls_cert": "KVFS_TLS_CERT", "tls_key": "KVFS_TLS_KEY", "tls_ca": "KVFS_TLS_CA"}

# A plaintext client's hint when a server never says HELLO (a TLS server waits for a ClientHello).
PLAINTEXT_HINT = ("no HELLO: if the server runs with --tls-cert, give this client --tls-ca "
                  "(or $KVFS_TLS_CA)")

# A TLS client's hint when the server hangs up right after the TLS handshake.
MUTUAL_TLS_HINT = ("TLS: if the server runs mutual TLS (--tls-ca), it requires a client "
                   "certificate signed by that CA: give this client --tls-cert/--tls-key")


def _files(cfg: TlsConfig) -> tuple[Path | None, Path | None, Path | None]:
    return cfg.tls_cert, cfg.tls_key, cfg.tls_ca


def _env_files() -> tuple[Path | None, Path | None, Path | None]:
    return tuple(Path(v) if (v := os.environ.get(TLS_ENV[name])) else None  # type: ignore[return-value]
                 for name in ("tls_cert", "tls_key", "tls_ca"))


def _load(what: str, fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except FileNotFoundError as exc:
        raise InvalidArgument(f"{what}: no such file {exc.filename or args[0]}") from None
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise InvalidArgument(f"{what}: cannot load {', '.join(str(a) for a in args if a)}: "
                              f"{exc}") from None


def _context(purpose: int, cert: Path | None, key: Path | None, ca: Path | None,
             who: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if key is not None and cert is None:
        raise InvalidArgument(f"{who}: --tls-key {key} needs --tls-cert")
    if cert is not None:
        _load(f"{who}: --tls-cert/--tls-key", ctx.load_cert_chain, str(cert),
              None if key is None else str(key))
    if ca is not None:
        _load(f"{who}: --tls-ca", ctx.load_verify_locations, str(ca))
    return ctx


def server_context(cfg: TlsConfig, who: str = "server") -> ssl.SSLContext | None:
    """A server's context, or None (plaintext) when ``cfg`` names no certificate."""
    cert, key, ca = _files(cfg)
    if cert is None:
        if key is not None or ca is not None:
            raise InvalidArgument(f"{who}: --tls-key/--tls-ca need --tls-cert (the server's "
                                  "own certificate)")
        return None
    ctx = _context(ssl.PROTOCOL_TLS_SERVER, cert, key, ca, who)
    ctx.verify_mode = ssl.CERT_REQUIRED if ca is not None else ssl.CERT_NONE
    return ctx


def client_context(cfg: TlsConfig | None, *, env: bool = True,
                   who: str = "client") -> ssl.SSLContext | None:
    """A client's context, or None (plaintext) when neither ``cfg`` nor (with ``env``)
    ``$KVFS_TLS_*`` names a file.  Verifies the server's certificate and host name."""
    files = _files(cfg) if cfg is not None else (None, None, None)
    if env and files == (None, None, None):
        files = _env_files()
    cert, key, ca = files
    if files == (None, None, None):
        return None
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT, cert, key, ca, who)  # CERT_REQUIRED, check_hostname
    if ca is None:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    return ctx


def connect_options(ctx: ssl.SSLContext | None, host: str, timeout_s: float) -> dict[str, Any]:
    """``loop.create_connection`` keywords for ``ctx`` (none for plaintext)."""
    if ctx is None:
        return {}
    return {"ssl": ctx, "server_hostname": host, "ssl_handshake_timeout": timeout_s,
            "ssl_shutdown_timeout": timeout_s}


def server_options(ctx: ssl.SSLContext | None, handshake_timeout_s: float) -> dict[str, Any]:
    """``loop.create_server`` keywords for ``ctx``: a TLS handshake must finish within the
    same ``handshake_timeout_s`` as the token handshake after it."""
    if ctx is None:
        return {}
    return {"ssl": ctx, "ssl_handshake_timeout": handshake_timeout_s,
            "ssl_shutdown_timeout": handshake_timeout_s}


_PLAINTEXT_PEER = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
                   "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "RECORD_TOO_LARGE")
_NEED_CLIENT_CERT = ("CERTIFICATE_REQUIRED", "PEER_DID_NOT_RETURN_A_CERTIFICATE")
_CLIENT_CERT_REFUSED = ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN",
                        "UNSUPPORTED_CERTIFICATE", "DECRYPT_ERROR")


def tls_failure(exc: BaseException, name: str) -> KVFSError:
    """What a TLS client's failure talking to ``name`` means, as a kvfs error."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return TlsError(f"TLS: the certificate of {name} failed verification: "
                        f"{exc.verify_message or exc.reason} (check --tls-ca, and that the "
                        "certificate names the host this client dialled)")
    if isinstance(exc, ssl.SSLError):
        reason = str(exc.reason or exc)
        if any(r in reason for r in _PLAINTEXT_PEER):
            return TlsError(f"TLS handshake with {name} failed ({reason}): the server does not "
                            "speak TLS; start it with --tls-cert, or drop --tls-* on this client")
        if any(r in reason for r in _NEED_CLIENT_CERT):
            return TlsError(f"TLS: {name} requires a client certificate (mutual TLS; {reason}): "
                            "give this client --tls-cert/--tls-key signed by the server's "
                            "--tls-ca")
        if any(r in reason for r in _CLIENT_CERT_REFUSED):
            return TlsError(f"TLS: {name} refused this client's certificate ({reason}): it must "
                            "be signed by the server's --tls-ca")
        return TlsError(f"TLS with {name} failed: {reason}")
    if isinstance(exc, (ConnectionError, EOFError)):
        return Unavailable(f"{name} closed the connection during the TLS handshake ({exc}): a "
                           "server without TLS, or one refusing this client's certificate?")
    return Unavailable(f"cannot connect to {name}: {getattr(exc, 'strerror', None) or exc}")
