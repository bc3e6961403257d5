"""Node-local state snapshots: the private store, the file format, the writer, the catalog, the relaunch's agreement
and transfer, and the schedule of which steps get one."""
