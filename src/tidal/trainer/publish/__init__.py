"""Publishing a policy: what it holds (broadcast), pushing it into the inference servers, the final export."""
