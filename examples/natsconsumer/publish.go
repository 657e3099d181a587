package natsconsumer

import (
	"context"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/exactlyonce/idempotency"
)

// Publish publishes data on subject with id as its Nats-Msg-Id header, the ID
// a [Consumer] deduplicates by. Publishing again with the same id and data,
// after a timeout say, is safe at any time: JetStream drops the copy within
// the stream's duplicate window (StreamConfig.Duplicates, two minutes by
// default), and the consumer skips it after that. The same id with other
// data is rejected by the consumer ([idempotency.ErrKeyReused]).
//
// id must be a valid key ([idempotency.ValidateKey]); Publish checks it
// first, since a consumer can only reject a message with an invalid ID.
func Publish(ctx context.Context, js jetstream.Publisher, subject, id string, data []byte) (*jetstream.PubAck, error) {
	if err := idempotency.ValidateKey(id); err != nil {
		return nil, err
	}
	return js.Publish(ctx, subject, data, jetstream.WithMsgID(id))
}
