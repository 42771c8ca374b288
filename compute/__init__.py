"""The compute's side: walproposer bridge, pagestream client, synthetic WAL for tests."""
