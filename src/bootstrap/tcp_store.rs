//! Rendezvous store over TCP. (Stub: being implemented.)
