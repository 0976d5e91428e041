from vf_escape.taskset import VfEscapeTaskset

__all__ = ["VfEscapeTaskset"]
