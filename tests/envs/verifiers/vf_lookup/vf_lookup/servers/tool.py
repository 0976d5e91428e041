import verifiers.v1 as vf

CODES = {"atlas": "4417", "borealis": "9023", "cobalt": "1358", "delta": "7761", "ember": "2094"}


class VfLookupToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "vf_lookup"

    @vf.tool
    def lookup(self, room: str) -> str:
        """The access code of a room, by its name."""
        code = CODES.get(room.strip().lower())
        return code if code is not None else f"no room named {room!r}"


if __name__ == "__main__":
    VfLookupToolset.run()
