"""A minimal DNS server for pod names: answers A queries under the cluster domain from the node
agent's view of Pods and Services and forwards everything else to the host's resolver.

Only what glibc's and Go's stub resolvers send is handled: one question per UDP query.
"""
from __future__ import annotations

import socket
import struct
import threading
from typing import Callable

QTYPE_A, QTYPE_AAAA = 1, 28


def _parse_question(data: bytes) -> tuple[str, int, int]:
    """(name, qtype, offset after the question)."""
    labels, i = [], 12
    while True:
        n = data[i]
        if n == 0:
            i += 1
            break
        if n & 0xC0:  # compression pointers never appear in a question we accept
            raise ValueError("compressed question")
        labels.append(data[i + 1:i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    qtype, _qclass = struct.unpack("!HH", data[i:i + 4])
    return ".".join(labels), qtype, i + 4


def _response(query: bytes, q_end: int, rcode: int, ips: list[str]) -> bytes:
    # Stay within the classic 512-byte UDP limit (there is no TCP fallback here): a headless
    # Service with more ready pods than that answers with the first ones, like a round robin.
    ips = ips[: max(0, (512 - q_end) // 16)]
    qid, flags = struct.unpack("!HH", query[:4])
    flags = 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | rcode  # QR, AA, RD copied, RA
    head = struct.pack("!HHHHHH", qid, flags, 1, len(ips), 0, 0)
    answers = b"".join(struct.pack("!HHHIH", 0xC00C, QTYPE_A, 1, 5, 4) + socket.inet_aton(ip) for ip in ips)
    return head + query[12:q_end] + answers


class DnsServer:
    """resolve(name) returns a list of IPv4 addresses for a cluster name (empty: NXDOMAIN) or
    None when the name is not the cluster's (forwarded upstream)."""

    def __init__(self, bind_ip: str, resolve: Callable[[str], list[str] | None], upstream: str | None):
        self.resolve = resolve
        self.upstream = upstream
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind_ip, 53))

    def serve_forever(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(4096)
            except OSError:
                return
            try:
                name, qtype, q_end = _parse_question(data)
                ips = self.resolve(name)
            except Exception:
                continue
            if ips is None:
                threading.Thread(target=self._forward, args=(data, addr), daemon=True).start()
                continue
            if not ips:
                self.sock.sendto(_response(data, q_end, 3, []), addr)  # NXDOMAIN
            elif qtype == QTYPE_A:
                self.sock.sendto(_response(data, q_end, 0, ips), addr)
            else:  # the name exists but has no record of this type (AAAA...): NODATA
                self.sock.sendto(_response(data, q_end, 0, []), addr)

    def _forward(self, data: bytes, addr) -> None:
        if not self.upstream:
            return
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(3)
        try:
            s.sendto(data, (self.upstream, 53))
            self.sock.sendto(s.recv(4096), addr)
        except OSError:
            pass
        finally:
            s.close()

    def close(self) -> None:
        self.sock.close()
