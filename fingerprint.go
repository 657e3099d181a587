package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// A fingerprint identifies a request, so that a key first used for one
// request is refused for another ([ErrKeyReused]). Those this package makes
// are tagged:
//
//	"\xffIDF"  magic, 4 bytes
//	version    1 byte: the algorithm (fingerprintVersion)
//	schema     8 bytes: what the encoding depends on (for a proto request,
//	           a digest of its message schema; for other kinds, their name)
//	sum        32 bytes: SHA-256 of the canonical request
//
// Two tagged fingerprints are compared only when their version and schema
// agree. When they differ, a new release changed the algorithm or the
// request's schema (two replicas mid-deploy, say), the two encodings are not
// comparable, and the call counts as the same request: a legitimate retry is
// never turned into KEY_REUSED by an upgrade. Untagged fingerprints (those
// of the first release, or a caller's own) are compared byte for byte with
// each other, and not at all with tagged ones.
const (
	fingerprintMagic   = "\xffIDF"
	fingerprintVersion = 2
	fingerprintLen     = len(fingerprintMagic) + 1 + 8 + sha256.Size
)

// Fingerprint identifies a proto request for key-reuse checks: the SHA-256
// of the full method name and the request's canonical encoding, tagged with
// the algorithm's version and a digest of the request's schema (see
// [Call.Fingerprint]).
//
// The canonical encoding is protobuf's deterministic one (map entries in key
// order) of the fields the server's schema knows: fields it does not know
// (sent by a newer client) are left out, because their bytes are kept as
// received and a client's retry may encode them in another order. So two
// requests are different when the method differs or any known field has
// another value; they are the same when they differ only in unknown fields
// or in encoding (map order, packed or not, field order).
func Fingerprint(fullMethod string, req proto.Message) ([]byte, error) {
	m := req.ProtoReflect()
	if hasUnknown(m) {
		m = proto.Clone(req).ProtoReflect()
		discardUnknown(m)
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m.Interface())
	if err != nil {
		return nil, errors.Join(errors.New("fingerprint request"), err)
	}
	return tagged(schemaDigest(m.Descriptor()), []byte(fullMethod), b), nil
}

// messageFingerprint identifies a message body of an at-least-once stream.
func messageFingerprint(body []byte) []byte {
	return tagged(kindDigest("message body"), body)
}

// tagged makes a tagged fingerprint of parts, each length-prefixed so that
// no two lists of parts hash alike.
func tagged(schema [8]byte, parts ...[]byte) []byte {
	h := sha256.New()
	for _, p := range parts {
		h.Write(binary.AppendUvarint(nil, uint64(len(p))))
		h.Write(p)
	}
	out := make([]byte, 0, fingerprintLen)
	out = append(out, fingerprintMagic...)
	out = append(out, fingerprintVersion)
	out = append(out, schema[:]...)
	return h.Sum(out)
}

// sameRequest reports whether a stored fingerprint and a new one name the
// same request, or cannot be compared (see the format above).
func sameRequest(stored, current []byte) bool {
	st, cur := isTagged(stored), isTagged(current)
	switch {
	case st && cur:
		head := len(fingerprintMagic) + 1 + 8
		if !bytes.Equal(stored[:head], current[:head]) {
			return true // another algorithm or schema: not comparable
		}
		return bytes.Equal(stored, current)
	case !st && !cur:
		return bytes.Equal(stored, current)
	}
	return true
}

func isTagged(fp []byte) bool {
	return len(fp) == fingerprintLen && string(fp[:len(fingerprintMagic)]) == fingerprintMagic
}

func kindDigest(kind string) (d [8]byte) {
	sum := sha256.Sum256([]byte("kind " + kind))
	copy(d[:], sum[:])
	return d
}

// schemaDigests caches schemaDigest by descriptor.
var schemaDigests sync.Map // protoreflect.MessageDescriptor -> [8]byte

// schemaDigest summarises what the canonical encoding of a message depends
// on: for it and every message it reaches, each field's number, kind,
// cardinality and packing. Names do not count: renaming a field changes no
// byte of the encoding.
func schemaDigest(md protoreflect.MessageDescriptor) [8]byte {
	if d, ok := schemaDigests.Load(md); ok {
		return d.([8]byte)
	}
	var b strings.Builder
	seen := map[protoreflect.FullName]bool{}
	var describe func(protoreflect.MessageDescriptor)
	describe = func(md protoreflect.MessageDescriptor) {
		if seen[md.FullName()] {
			fmt.Fprintf(&b, "ref %s;", md.FullName())
			return
		}
		seen[md.FullName()] = true
		fields := md.Fields()
		order := make([]int, fields.Len())
		for i := range order {
			order[i] = i
		}
		slices.SortFunc(order, func(x, y int) int { return int(fields.Get(x).Number() - fields.Get(y).Number()) })
		fmt.Fprintf(&b, "msg %s {", md.FullName())
		for _, i := range order {
			fd := fields.Get(i)
			fmt.Fprintf(&b, "%d %v %v %t %t;", fd.Number(), fd.Kind(), fd.Cardinality(), fd.IsPacked(), fd.IsMap())
			if fd.Message() != nil {
				describe(fd.Message())
			}
		}
		b.WriteString("}")
	}
	describe(md)
	sum := sha256.Sum256([]byte(b.String()))
	var d [8]byte
	copy(d[:], sum[:])
	schemaDigests.Store(md, d)
	return d
}

// hasUnknown reports whether m, or any message in it, holds unknown fields.
func hasUnknown(m protoreflect.Message) bool {
	if len(m.GetUnknown()) > 0 {
		return true
	}
	found := false
	eachMessage(m, func(sub protoreflect.Message) bool {
		found = hasUnknown(sub)
		return !found
	})
	return found
}

// discardUnknown removes the unknown fields of m and of every message in it.
func discardUnknown(m protoreflect.Message) {
	if m.GetUnknown() != nil {
		m.SetUnknown(nil)
	}
	eachMessage(m, func(sub protoreflect.Message) bool {
		discardUnknown(sub)
		return true
	})
}

// eachMessage calls f for each message directly inside m (singular,
// repeated and map values) until f returns false.
func eachMessage(m protoreflect.Message, f func(protoreflect.Message) bool) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsMap():
			if fd.MapValue().Message() == nil {
				return true
			}
			more := true
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				more = f(mv.Message())
				return more
			})
			return more
		case fd.IsList():
			if fd.Message() == nil {
				return true
			}
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				if !f(l.Get(i).Message()) {
					return false
				}
			}
			return true
		case fd.Message() != nil:
			return f(v.Message())
		}
		return true
	})
}
