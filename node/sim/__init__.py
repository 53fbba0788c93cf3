"""The simulator: M workers in one process on the same outer core as the daemon (``simulator``), one per method of the
papers (``methods``). Its command is ``locoswarm simulate`` (``locoswarm.node.commands.simulate``)."""
