"""spark_streaming."""
