//! Configuration (stub).
