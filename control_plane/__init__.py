"""The ``pagestore`` CLI and the local cluster it launches and wires."""
