from vf_echo.taskset import VfEchoTaskset

__all__ = ["VfEchoTaskset"]
