"""Speculative decoding: cheap draft proposals (n-gram prompt lookup) and the rejection sampler
that keeps exactly the draft tokens the target model's distribution allows."""
