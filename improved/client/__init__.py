"""What a mesh service uses to take part in the loop: `sdk.MeshClient` to propose, refine and
serve ApplyOrders, and `acceptance.check` to verify on the audit chain that an order it was
sent was really accepted. Depends on the protocol and the core only, never on the daemon."""
