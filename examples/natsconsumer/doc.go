// Package natsconsumer applies each message of a NATS JetStream stream to
// PostgreSQL exactly once, although JetStream delivers it at least once.
//
// # The guarantee
//
// A message's effect commits if and only if its ID commits with it, in one
// PostgreSQL transaction ([idempotency.Store.ProcessMessage]), and the
// message is acknowledged only after that commit. So:
//
//   - every message is applied at least once: JetStream redelivers whatever
//     was not acknowledged (the AckWait expired, the consumer crashed or lost
//     its connection, or it nacked after a rollback);
//   - every message is applied at most once: once its ID has committed, every
//     later delivery of it (a redelivery, or the same Nats-Msg-Id published
//     again after JetStream's duplicate window) finds the ID and is only
//     acknowledged.
//
// The database, not the consumer's memory, decides, so this holds across
// crashes, restarts and any number of consumers sharing the durable.
//
// # Use
//
// Create a durable pull consumer with explicit acks, and run a [Consumer] on
// it with a [Handler] that writes through the transaction it is given:
//
//	cons, err := js.CreateOrUpdateConsumer(ctx, "CREDITS", jetstream.ConsumerConfig{
//		Durable:   "credits-applier",
//		AckPolicy: jetstream.AckExplicitPolicy,
//		AckWait:   30 * time.Second,
//	})
//	...
//	c, err := natsconsumer.New(store, cons, natsconsumer.ApplyCredit)
//	...
//	err = c.Run(ctx)
//
// Publishers set each message's ID with [Publish]. [ApplyCredit] and
// [CreditTables] are the example's business: a credit row per message and a
// balance per account.
//
// # Acknowledgements
//
//	outcome                                   action
//	applied now, or a duplicate               Ack
//	handler or database error, rolled back,
//	or a handler's panic (recovered)          NakWithDelay: redelivered after a backoff
//	same ID being processed elsewhere         NakWithDelay: the store's retry delay,
//	                                          at least the backoff's base
//	Final error, invalid ID, ID reused        Term: never redelivered
//	the handler failed or panicked on each
//	of its attempts (WithMaxAttempts, 10)     Term: never redelivered (GaveUp)
//
// [WithOutcomeHook] reports each of them. The database's own failures (down,
// overloaded, a lock or serialization conflict) are not the message's, and
// do not count towards its attempts. A deferred constraint or trigger of the
// handler's tables that refuses the writes at COMMIT is the handler's
// failure, as if its statement had failed, unless it can never pass (a
// unique, check or exclusion violation), which is final.
//
// A store made with [idempotency.WithSuggestedRetryDelay](0) suggests no
// delay for a message whose ID another delivery holds; the consumer still
// waits the retry backoff's base ([WithRetryBackoff], 100 milliseconds by
// default) before it is redelivered, so that it does not come straight back
// again and again, a hot loop, while the other delivery runs.
//
// # Message IDs
//
// The Nats-Msg-Id header, or for a message without one its place in its
// stream's incarnation, "seq:<stream>.<sequence>.<stored>", stored being
// when JetStream stored it: a stream deleted and created again has new
// places. A publisher's ID never takes a place: one that starts with "seq:"
// is recorded hashed. [Consumer] has the details, and what an upgrade from
// the earlier "seq:<stream>:<sequence>" form changes.
package natsconsumer
