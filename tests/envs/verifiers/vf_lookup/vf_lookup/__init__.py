from vf_lookup.taskset import VfLookupTaskset

__all__ = ["VfLookupTaskset"]
