"""Which daemon holds which rank of an instance: the rules of the rendezvous's directory, the
key layout of the same directory in etcd and a small etcd client, and asking a rendezvous
(``kvxferd plan --rendezvous``). The daemon's side of it, on its loop, is
:mod:`kvxferd.control.rendezvous`."""
