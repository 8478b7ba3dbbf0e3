//! Mutual HMAC-SHA256 challenge-response on a fresh connection. (Stub: being implemented.)
