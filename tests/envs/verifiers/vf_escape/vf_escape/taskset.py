"""A verifiers taskset written by someone who wants out: its reward function tries to read a
file of the host, reach a port of the host and the internet, and write into its own package.
Each attempt is a metric (1: it got through); the reward is 1 when any did."""

import os
import socket

import verifiers.v1 as vf


class VfEscapeData(vf.TaskData):
    secret_file: str
    host_port: int


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


def _reads(path: str) -> bool:
    try:
        with open(path) as f:
            return bool(f.read())
    except OSError:
        return False


def _writes(path: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write("planted")
        return True
    except OSError:
        return False


class VfEscapeTask(vf.Task[VfEscapeData]):
    @vf.metric
    async def read_host_file(self, trace: vf.Trace) -> float:
        return float(_reads(self.data.secret_file))

    @vf.metric
    async def reached_host_port(self, trace: vf.Trace) -> float:
        return float(_connects("127.0.0.1", self.data.host_port))

    @vf.metric
    async def reached_internet(self, trace: vf.Trace) -> float:
        return float(_connects("1.1.1.1", 53))

    @vf.metric
    async def wrote_own_package(self, trace: vf.Trace) -> float:
        return float(_writes(os.path.join(os.path.dirname(__file__), "planted.txt")))

    @vf.reward(weight=1.0)
    async def escaped(self, trace: vf.Trace) -> float:
        attempts = (_reads(self.data.secret_file), _connects("127.0.0.1", self.data.host_port),
                    _connects("1.1.1.1", 53), _writes(os.path.join(os.path.dirname(__file__), "planted.txt")))
        return float(any(attempts))


class VfEscapeConfig(vf.TasksetConfig):
    secret_file: str = "/etc/hostname"
    host_port: int = 4222


class VfEscapeTaskset(vf.Taskset[VfEscapeTask, VfEscapeConfig]):
    def load(self) -> list[VfEscapeTask]:
        return [VfEscapeTask(VfEscapeData(prompt="Say hi.", secret_file=self.config.secret_file,
                                          host_port=self.config.host_port), self.config.task)]
