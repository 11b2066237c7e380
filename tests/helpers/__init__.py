"""What the test modules share: tiny models, servers, engines, file writers and references. A test
module imports from here, never from another test module."""
