"""A draft process that never answers start-up (tests/runtime/test_lane_lifecycle.py points the process
lane's entry point here): it holds its end of the socket until the caller closes it or dies."""

import socket


def main(argv: list) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    while sock.recv(1 << 16):  # b"" at end-of-file: the caller gave up (and kills this process) or died
        pass
    return 0
