"""Spark on Lightgate: a PySpark data source that reads and writes first-level topics
over the native protocol, the analytics jobs built on it (alert rules), and a device
simulator to feed them; `lightgate analytics` and `lightgate simulate` run them."""
