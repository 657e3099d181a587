package idempotency

import (
	"crypto/sha256"
	"errors"

	"google.golang.org/protobuf/proto"
)

// Fingerprint identifies a request for key-reuse checks: SHA-256 over the
// full method name and the deterministic protobuf encoding of req. A key
// first used with one fingerprint is rejected with [ErrKeyReused] for any
// other.
//
// The fingerprint changes when the method or any field of req changes, and
// also when the bytes of the encoding change for the same message: fields
// the server's copy of the schema does not know are kept and encoded as
// received, so their order counts.
func Fingerprint(fullMethod string, req proto.Message) ([]byte, error) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		return nil, errors.Join(errors.New("fingerprint request"), err)
	}
	h := sha256.New()
	h.Write([]byte(fullMethod))
	h.Write([]byte{0})
	h.Write(b)
	return h.Sum(nil), nil
}
