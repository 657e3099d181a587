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
//	handler or database error, rolled back    NakWithDelay: redelivered after a backoff
//	same ID being processed elsewhere         NakWithDelay: the store's retry delay
//	Final error, invalid ID, ID reused        Term: never redelivered
//
// [WithOutcomeHook] reports each of them.
package natsconsumer
